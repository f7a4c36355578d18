// `flatshardctl drain`: refuse new groups and joins, then wait for in-flight work.
// `flatshardctl undrain`: accept them again.

#include <unistd.h>

#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {
namespace {

std::string InFlight(const v1::DrainProgress& p) {
  return absl::StrFormat("%d open summons, %d pending collectives, %d pending joins",
                         p.open_summons(), p.pending_collectives(), p.pending_joins());
}

nlohmann::json DrainJson(const v1::DrainProgress& p) {
  return {{"done", p.done()},
          {"timed_out", p.timed_out()},
          {"open_summons", p.open_summons()},
          {"pending_collectives", p.pending_collectives()},
          {"pending_joins", p.pending_joins()},
          {"elapsed_seconds", p.elapsed_seconds()}};
}

int Drain(AdminCall& call) {
  const bool progress = !call.json() && ::isatty(STDOUT_FILENO) == 1;
  grpc::ClientContext ctx;
  call.SetDeadline(ctx, absl::Seconds(10));  // the daemon ends the stream at --timeout-ms
  v1::DrainRequest request;
  request.set_timeout_ms(call.timeout_ms());
  std::unique_ptr<grpc::ClientReader<v1::DrainProgress>> reader = call.stub().Drain(&ctx, request);
  v1::DrainProgress last, p;
  bool any = false;
  while (reader->Read(&p)) {
    last = p;
    any = true;
    if (progress) {
      std::cout << "\r\033[Kdraining: " << InFlight(p)
                << absl::StrFormat(" (%.1fs)", p.elapsed_seconds()) << std::flush;
    }
  }
  const grpc::Status status = reader->Finish();
  if (progress && any) std::cout << "\r\033[K" << std::flush;
  if (!status.ok()) return call.Fail(status);
  if (!any) return call.Error("the daemon ended the drain without a report", 1);
  if (call.json()) {
    std::cout << DrainJson(last).dump(2) << "\n";
  } else if (last.done()) {
    std::cout << absl::StrFormat("drained: no work in flight after %.1fs; new joins are refused\n",
                                 last.elapsed_seconds());
  } else {
    std::cout << absl::StrFormat("drain timed out after %.1fs: %s still in flight\n",
                                 last.elapsed_seconds(), InFlight(last));
  }
  return last.done() ? 0 : 1;
}

}  // namespace

int RunDrainCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "drain";
  spec.description =
      "Drains the daemon: from now on it refuses new groups and joins (JoinGroup fails with\n"
      "UNAVAILABLE \"flatshardd is draining\") and its gRPC health service answers NOT_SERVING;\n"
      "then waits until no summon is open and no collective or join is pending, or until the\n"
      "timeout. On a terminal a line shows what is still in flight. Draining lasts until\n"
      "'flatshardctl undrain' or until the daemon stops; running drain again only waits again.\n";
  spec.default_timeout_ms = 30000;
  spec.timeout_help =
      "how long to wait for in-flight work (default 30000; 0: report once and return)";
  spec.exit_help =
      "Exit status: 0 when nothing is in flight any more; 1 when the daemon cannot be reached\n"
      "or refuses, or work is still in flight at the timeout; 2 for bad flags.\n";
  return RunAdminCommand(spec, args, Drain);
}

int RunUndrainCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "undrain";
  spec.description =
      "Returns a drained daemon to service: it accepts new groups and joins again and its gRPC\n"
      "health service answers SERVING. A daemon that is not draining is left as it is (and\n"
      "says so). Refused while the daemon shuts down.\n";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    return CallAndPrint(
        call, &v1::AdminService::Stub::Undrain, v1::UndrainRequest(),
        [](const v1::UndrainResponse& r) -> nlohmann::json {
          return {{"was_draining", r.was_draining()}, {"draining", false}};
        },
        [](const v1::UndrainResponse& r) {
          std::cout << (r.was_draining() ? "undrained: new groups and joins are accepted again\n"
                                         : "not draining: nothing to undo\n");
        });
  });
}

}  // namespace flatshard::cli
