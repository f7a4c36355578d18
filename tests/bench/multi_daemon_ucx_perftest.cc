#include "tests/bench/multi_daemon_ucx_perftest.h"

#include <sys/wait.h>

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "tests/bench/bench_support.h"
#include "tests/bench/multi_daemon_processes.h"

namespace flatshard::bench::md {

namespace fs = std::filesystem;

std::set<std::string> UcxEndpointConfigs(absl::string_view log) {
  std::set<std::string> out;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t at = line.find("ep_cfg[");
    if (at == absl::string_view::npos) continue;
    const size_t colon = line.find(": ", at);
    if (colon == absl::string_view::npos) continue;
    std::string cfg(line.substr(colon + 2));
    while (!cfg.empty() && (cfg.back() == '\r' || cfg.back() == ' ')) cfg.pop_back();
    out.insert(cfg);
  }
  return out;
}

std::string JoinOrNone(const std::set<std::string>& s) {
  return s.empty() ? "(none reported)" : absl::StrJoin(s, ", ");
}

// Whether something listens on TCP `port` (IPv4 or IPv6, any address), from /proc/net: a probe
// connection would count as ucx_perftest's one client.
bool PortListening(int port) {
  const std::string hex_port = absl::StrCat(":", absl::Hex(port, absl::kZeroPad4));
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      // sl local_address rem_address st ...; st 0A = LISTEN
      if (f.size() > 3 && f[3] == "0A" &&
          absl::EndsWith(absl::AsciiStrToUpper(f[1]), absl::AsciiStrToUpper(hex_port))) {
        return true;
      }
    }
  }
  return false;
}

absl::StatusOr<UcxPerfResult> RunUcxPerftest(const std::string& bin, int64_t size, int iters,
                                             int warmup, bool error_handling,
                                             const std::vector<std::string>& env,
                                             const fs::path& dir, absl::Duration timeout) {
  if (!FindInPath(bin)) {
    return absl::FailedPreconditionError(
        absl::StrCat(bin, " not found (install ucx-utils, or pass --ucx_perftest)"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int port = bench::PickFreeLoopbackPort();
    if (port <= 0) return absl::InternalError("no free TCP port on 127.0.0.1");
    const std::string server_log = (dir / "ucx_perftest_server.log").string();
    const std::string client_log = (dir / "ucx_perftest_client.log").string();
    FS_ASSIGN_OR_RETURN(pid_t server, SpawnTool({bin, "-p", absl::StrCat(port)}, env, server_log));
    while (!PortListening(port) && absl::Now() < deadline) {
      int st = 0;
      if (::waitpid(server, &st, WNOHANG) == server) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (!PortListening(port)) {
      KillTool(server);
      last = absl::UnavailableError(absl::StrCat("ucx_perftest server did not listen on port ",
                                                 port, "; its output:\n",
                                                 bench::Tail(bench::ReadText(server_log), 2000)));
      continue;
    }
    std::vector<std::string> args = {
        bin,  "127.0.0.1",        "-p", absl::StrCat(port),  "-t", "tag_bw",
        "-s", absl::StrCat(size), "-n", absl::StrCat(iters), "-w", absl::StrCat(warmup)};
    if (error_handling) args.push_back("-e");
    absl::StatusOr<pid_t> client = SpawnTool(args, env, client_log);
    if (!client.ok()) {
      KillTool(server);
      return client.status();
    }
    absl::StatusOr<int> cst = WaitTool(*client, deadline, "ucx_perftest client");
    absl::StatusOr<int> sst =
        WaitTool(server, absl::Now() + absl::Seconds(20), "ucx_perftest server");
    const std::string cout_text = bench::ReadText(client_log);
    const std::string sout_text = bench::ReadText(server_log);
    if (!cst.ok() || !WIFEXITED(*cst) || WEXITSTATUS(*cst) != 0) {
      return absl::InternalError(absl::StrCat(
          "ucx_perftest client failed (",
          cst.ok() ? bench::DescribeWaitStatus(*cst) : std::string(cst.status().message()),
          "); its output:\n", bench::Tail(cout_text, 2000), "\n-- server:\n",
          bench::Tail(sout_text, 1000)));
    }
    (void)sst;  // the server's exit does not change the client's figure
    UcxPerfResult r;
    // "Final:   <iters> <p50> <avg overhead us> <overall overhead us> <bw avg> <bw overall>
    //  <msgrate avg> <msgrate overall>": the overall overhead is the time per message over
    // every measured iteration.
    for (absl::string_view line : absl::StrSplit(cout_text, '\n')) {
      if (!absl::StartsWith(line, "Final:")) continue;
      std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 5 && !absl::SimpleAtod(f[4], &r.time_us)) r.time_us = 0;
    }
    if (r.time_us <= 0) {
      return absl::InternalError(absl::StrCat("no \"Final:\" line in ucx_perftest's output:\n",
                                              bench::Tail(cout_text, 2000)));
    }
    r.client_cfg = UcxEndpointConfigs(cout_text);
    r.server_cfg = UcxEndpointConfigs(sout_text);
    return r;
  }
  return last;
}

}  // namespace flatshard::bench::md
