// flatshardd benchmarks against a real daemon process (never part of the default test run).
//
//   build/tests/bench/flatshard_daemon_benchmark [--bytes N] [--iters N] [--world_sizes 2,4]
//       [--commit_bytes 4KiB,64MiB] [--commit_iters N] [--state_dir_root DIR]
//       [--skip_latency] [--skip_unshard] [--skip_commit] [--unshard_state_dir]
//
// Starts flatshardd on a private socket and segment prefix, then measures, side by side in the
// same run (DESIGN.md "Performance targets"):
//
// 1. Latency. One rank registers a model whose single unit is 4 KiB of float32; then --iters
//    iterations (after --warmup) of Summon(writeback=false) + End, alternated A/B, B/A with the
//    same number of empty `Ping` RPCs to the same socket (two per iteration: Summon+End is two
//    RPCs). Once through the client library (what a trainer sees: RPC + segment mapping + views;
//    its Pings go over a raw stub on a channel with the library's arguments; its Summons take
//    the transition lane, a stream message each), once more with the lane off
//    (FLATSHARD_NO_TRANSITION_LANE=1: unary Summons, "lib-unary"), once through raw stubs
//    (unary RPCs only, Pings on the same channel). Then the steady-state unit transition: a
//    Summon that ends the previous summon in the same request (SummonRequest.end_first),
//    alternated with one Ping. Prints p50/p99 of each RPC and the ratios to Ping (target: p50
//    <= 1.2x, p99 <= 1.5x).
// 2. Unshard bandwidth. For each world size, every rank a thread with its own channel: one unit
//    of --bytes float32 (default 1 GiB; shrunk with a note when /dev/shm or memory is short).
//    Summon(writeback=false) (the all-gather into one shared node copy) as seen by the clients:
//    the max over ranks of Summon RPC + mapping the returned segment; median of --reps after one
//    warm-up. Summon(writeback=true) (a private copy per rank) reported separately, and End for
//    both. Baseline: single-thread memcpy of the same bytes on touched buffers (median of 5),
//    measured in the same run just before. Rows in nccl-tests columns, busbw = algbw * (n-1)/n,
//    and the ratio to memcpy (target <= 1.2 for the shared copy). Context rows decompose what
//    the daemon's unshard path costs on one thread: memcpy into fresh pages, creating a
//    fallocated shm segment, and both together.
// 3. Commit and writeback End. One rank, client library, one unit per --commit_bytes size
//    (default 4 KiB and 64 MiB): Commit after writing one element of the shard, alternated
//    A/B, B/A with Summon(writeback=true) + one element written + End (the End writes back and
//    commits); --commit_iters iterations (units over 1 MiB: a tenth). Twice: on the daemon
//    above, and on a second daemon of the same binary with --state_dir (under
//    --state_dir_root, default $TMPDIR; each commit writes fsynced records there). p50/p99.
//
// Headline figures are also printed as "# FIGURE name value unit lower|higher" lines, which
// scripts/bench_ab.sh collects to compare two daemon builds.
//
// The unshard part maps segments itself (common/shm_segment.h, as the client library does)
// rather than through flatshard::client::Client: the library's SegmentCache keeps every
// segment it mapped until 4096 are cached, and whenever the daemon hands out a new segment (per
// summon before it kept buffers; still when a kept buffer is busy) repeated 1 GiB summons
// through it would keep gigabytes of unlinked shm alive. The latency part reports the library's
// mmaps per summon and how many unlinked segments it still maps; the unshard part reports the
// daemon's /dev/shm footprint once every End returned.
//
// Usage: --flatshardd PATH runs another daemon build (e.g. an older commit) against the same
// client code. --unshard_state_dir gives the daemon of parts 1 and 2 a --state_dir (records
// around every writeback End's commit) instead of --ephemeral.
//
// Exits non-zero with a message on any error. The daemons, their socket and state
// directories and every /dev/shm/<prefix>.* are removed at exit (also on error and on
// SIGINT/SIGTERM; the daemons get SIGTERM if this process dies).

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/manifest.h"
#include "common/policy.h"
#include "common/proto_convert.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30,
          "bytes of the unit in the unshard benchmark (float32; rounded down to whole elements)");
ABSL_FLAG(int32_t, iters, 2000, "measured iterations of the latency benchmark");
ABSL_FLAG(int32_t, warmup, 200, "warm-up iterations of the latency benchmark");
ABSL_FLAG(int32_t, reps, 5, "measured repetitions per unshard row (after one warm-up)");
ABSL_FLAG(std::vector<std::string>, world_sizes, std::vector<std::string>({"2", "4"}),
          "world sizes of the unshard benchmark (all ranks local), comma-separated");
ABSL_FLAG(bool, skip_latency, false, "skip the Summon+End vs Ping latency benchmark");
ABSL_FLAG(bool, skip_unshard, false, "skip the unshard bandwidth benchmark");
ABSL_FLAG(std::vector<std::string>, commit_bytes, std::vector<std::string>({"4096", "64MiB"}),
          "unit sizes of the Commit / writeback End benchmark, comma-separated (suffixes KiB, "
          "MiB, GiB)");
ABSL_FLAG(int32_t, commit_iters, 200,
          "measured iterations of each Commit / writeback End row for units up to 1 MiB (larger "
          "units: a tenth, at least 5; warm-up: --warmup, likewise scaled)");
ABSL_FLAG(std::string, state_dir_root, "",
          "where the Commit benchmark's second daemon gets its --state_dir (a fresh "
          "subdirectory, removed at exit; pick the disk a deployment would use); empty: $TMPDIR");
ABSL_FLAG(bool, skip_commit, false, "skip the Commit / writeback End benchmark");
ABSL_FLAG(bool, unshard_state_dir, false,
          "run the latency and unshard benchmarks on a daemon with a --state_dir (a fresh "
          "subdirectory of --state_dir_root, removed at exit) instead of an --ephemeral one");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard {
namespace {

namespace fs = std::filesystem;
using bench::Clock;
using bench::LoadAverage;
using bench::ManifestJson;
using bench::Median;
using bench::MemAvailableBytes;
using bench::MicrosSince;
using bench::Percentile;
using bench::PrintFigure;
using bench::RetainedDeletedMappings;
using bench::ScaledIters;
using bench::SegmentsWithPrefix;
using DaemonProcess = bench::BenchDaemon;
using Stub = v1::ShardService::Stub;
constexpr const char* kPolicyJson = bench::kPolicyJson;

// ---- Helpers ----------------------------------------------------------------------------------

// The channel arguments of flatshard::client::Client::Connect; `rank_tag` >= 0 gives a channel
// its own connection (gRPC shares subchannels between channels with equal arguments).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, int rank_tag = -1) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  if (rank_tag >= 0) args.SetInt("flatshard.bench.rank", rank_tag);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

void SetDeadline(grpc::ClientContext* ctx, std::chrono::seconds s) {
  ctx->set_deadline(std::chrono::system_clock::now() + s);
}

absl::Status RpcError(absl::string_view what, const grpc::Status& s) {
  const absl::Status st = FromGrpcStatus(s);
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

v1::Caller MakeCaller(const std::string& group, int rank, uint64_t session) {
  v1::Caller c;
  c.set_group(group);
  c.set_rank(rank);
  c.set_token("bench");
  c.set_session(session);
  return c;
}

absl::StatusOr<uint64_t> RawJoin(Stub* stub, const std::string& group, int world, int rank) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, std::chrono::seconds(60));
  v1::JoinGroupRequest req;
  req.set_group(group);
  req.set_world_size(world);
  req.set_rank(rank);
  req.set_token("bench");
  v1::JoinGroupResponse resp;
  if (grpc::Status s = stub->JoinGroup(&ctx, req, &resp); !s.ok()) {
    return RpcError(absl::StrCat("JoinGroup ", group, " rank ", rank), s);
  }
  return resp.session();
}

absl::StatusOr<v1::RegisterModuleResponse> RawRegister(Stub* stub, const v1::Caller& caller,
                                                       int64_t numel) {
  FS_ASSIGN_OR_RETURN(Manifest manifest, ManifestFromJson(ManifestJson(numel)));
  FS_ASSIGN_OR_RETURN(Policy policy, PolicyFromJson(kPolicyJson));
  v1::RegisterModuleRequest req;
  *req.mutable_caller() = caller;
  req.set_module("");
  *req.mutable_manifest() = ToProto(manifest);
  *req.mutable_policy() = ToProto(policy);
  req.set_init(v1::INIT_MODE_ZEROS);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, std::chrono::seconds(120));
  v1::RegisterModuleResponse resp;
  if (grpc::Status s = stub->RegisterModule(&ctx, req, &resp); !s.ok()) {
    return RpcError(absl::StrCat("RegisterModule rank ", caller.rank()), s);
  }
  if (resp.plan().units_size() != 1 || resp.shards_size() != 1) {
    return absl::InternalError(absl::StrCat("expected one unit, the plan has ",
                                            resp.plan().units_size(), " and ", resp.shards_size(),
                                            " shards"));
  }
  return resp;
}

// `end_first` != 0: that summon is ended by the same RPC (SummonRequest.end_first).
absl::StatusOr<v1::SummonResponse> RawSummon(Stub* stub, const v1::Caller& caller, bool writeback,
                                             std::chrono::seconds deadline,
                                             uint64_t end_first = 0) {
  v1::SummonRequest req;
  *req.mutable_caller() = caller;
  if (end_first != 0) req.add_end_first(end_first);
  req.mutable_options()->set_recurse(true);
  req.mutable_options()->set_writeback(writeback);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  v1::SummonResponse resp;
  if (grpc::Status s = stub->Summon(&ctx, req, &resp); !s.ok()) {
    return RpcError(absl::StrCat("Summon rank ", caller.rank()), s);
  }
  return resp;
}

absl::Status RawEnd(Stub* stub, const v1::Caller& caller, uint64_t summon,
                    std::chrono::seconds deadline) {
  v1::EndSummonRequest req;
  *req.mutable_caller() = caller;
  req.set_summon(summon);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  v1::EndSummonResponse resp;
  if (grpc::Status s = stub->EndSummon(&ctx, req, &resp); !s.ok()) {
    return RpcError(absl::StrCat("EndSummon rank ", caller.rank()), s);
  }
  return absl::OkStatus();
}

absl::Status RawPing(Stub* stub) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, std::chrono::seconds(10));
  v1::PingRequest req;
  v1::PingResponse resp;
  if (grpc::Status s = stub->Ping(&ctx, req, &resp); !s.ok()) return RpcError("Ping", s);
  return absl::OkStatus();
}

// ---- 1. Latency -------------------------------------------------------------------------------

struct LatencySamples {
  std::vector<double> summon, end, summon_end;  // one per iteration
  std::vector<double> ping;                     // two per iteration
  std::vector<double> ping_pair;                // one per iteration
  // The unit transition: Summon ending the previous summon in the same RPC (end_first),
  // alternated with one Ping each (`transition_ping`).
  std::vector<double> transition, transition_ping;

  // One Summon (t0..t1) and End (t1..t2).
  void RecordSummonEnd(Clock::time_point t0, Clock::time_point t1, Clock::time_point t2) {
    summon.push_back(MicrosSince(t0, t1));
    end.push_back(MicrosSince(t1, t2));
    summon_end.push_back(MicrosSince(t0, t2));
  }
};

void PrintLatency(absl::string_view variant, const LatencySamples& s, int64_t unit_bytes) {
  const double ping50 = Percentile(s.ping, 50), ping99 = Percentile(s.ping, 99);
  const double pair50 = Percentile(s.ping_pair, 50), pair99 = Percentile(s.ping_pair, 99);
  auto row = [&](absl::string_view what, const std::vector<double>& v, double base50, double base99,
                 absl::string_view base) {
    const double p50 = Percentile(v, 50), p99 = Percentile(v, 99);
    const double r50 = p50 / base50, r99 = p99 / base99;
    std::printf("%-8s %-14s %8" PRId64 " %8zu %10.1f %10.1f %9.2f %9.2f  %-10s %s\n",
                std::string(variant).c_str(), std::string(what).c_str(), unit_bytes, v.size(), p50,
                p99, r50, r99, std::string(base).c_str(),
                base.empty() ? "" : (r50 <= 1.2 && r99 <= 1.5 ? "ok" : "MISS"));
  };
  row("Ping", s.ping, ping50, ping99, "");
  row("Ping+Ping", s.ping_pair, pair50, pair99, "");
  row("Summon", s.summon, ping50, ping99, "Ping");
  row("End", s.end, ping50, ping99, "Ping");
  row("Summon+End", s.summon_end, pair50, pair99, "Ping+Ping");
  // The literal reading of the issue: two RPCs against one echo.
  row("Summon+End", s.summon_end, ping50, ping99, "Ping(1)");
  // What a trainer's steady state pays per unit with end_first: one RPC.
  row("Transition", s.transition, Percentile(s.transition_ping, 50),
      Percentile(s.transition_ping, 99), "Ping");
}

void PrintLatencyHeader() {
  std::printf("%-8s %-14s %8s %8s %10s %10s %9s %9s  %-10s %s\n", "#variant", "rpc", "size",
              "samples", "p50(us)", "p99(us)", "p50/base", "p99/base", "base", "target");
}

// Runs `a` and `b` alternately (A,B then B,A) for warmup + iters iterations.
absl::Status Alternate(int warmup, int iters, const std::function<absl::Status(bool)>& a,
                       const std::function<absl::Status(bool)>& b) {
  for (int i = 0; i < warmup + iters; ++i) {
    const bool record = i >= warmup;
    if (i % 2 == 0) {
      FS_RETURN_IF_ERROR(a(record));
      FS_RETURN_IF_ERROR(b(record));
    } else {
      FS_RETURN_IF_ERROR(b(record));
      FS_RETURN_IF_ERROR(a(record));
    }
  }
  return absl::OkStatus();
}

// Two Pings, timed each and together.
absl::Status PingPair(Stub* stub, bool record, LatencySamples* s) {
  const auto t0 = Clock::now();
  FS_RETURN_IF_ERROR(RawPing(stub));
  const auto t1 = Clock::now();
  FS_RETURN_IF_ERROR(RawPing(stub));
  const auto t2 = Clock::now();
  if (record) {
    s->ping.push_back(MicrosSince(t0, t1));
    s->ping.push_back(MicrosSince(t1, t2));
    s->ping_pair.push_back(MicrosSince(t0, t2));
  }
  return absl::OkStatus();
}

// Alternates a timed `transition` (one RPC) with one timed Ping: warmup + iters iterations.
absl::Status MeasureTransitions(Stub* stub, int warmup, int iters,
                                const std::function<absl::Status()>& transition,
                                LatencySamples* out) {
  auto timed = [&](bool record, const std::function<absl::Status()>& f,
                   std::vector<double>* samples) -> absl::Status {
    const auto t0 = Clock::now();
    FS_RETURN_IF_ERROR(f());
    if (record) samples->push_back(MicrosSince(t0, Clock::now()));
    return absl::OkStatus();
  };
  return Alternate(
      warmup, iters, [&](bool record) { return timed(record, transition, &out->transition); },
      [&](bool record) {
        return timed(
            record, [&] { return RawPing(stub); }, &out->transition_ping);
      });
}

absl::Status LatencyWithClientLibrary(const DaemonProcess& d, int warmup, int iters,
                                      LatencySamples* out, int64_t* map_calls,
                                      std::pair<int64_t, int64_t>* retained) {
  client::ClientOptions options;
  options.address = d.address();
  FS_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c, client::Client::Connect(options));
  FS_RETURN_IF_ERROR(c->Join("latency-lib", 1, 0, "bench"));
  FS_ASSIGN_OR_RETURN(client::RegisteredModule model,
                      c->Register("", ManifestJson(1024), kPolicyJson, client::InitMode::kZeros));
  // The Pings: same socket, a channel with the library's arguments (so gRPC may share the
  // library's connection; the library does not expose its channel).
  std::shared_ptr<grpc::Channel> channel = MakeChannel(d.address());
  std::unique_ptr<Stub> stub = v1::ShardService::NewStub(channel);

  client::SummonOptions so;
  so.writeback = false;
  {
    // One checked summon: the view is the 1024 zeros of "weight".
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::SummonedParams> s, c->Summon("", "", so));
    const client::ParamView* w = s->Find("weight");
    if (w == nullptr || w->numel != 1024 || w->data == nullptr ||
        static_cast<const float*>(w->data)[1023] != 0.0f) {
      return absl::InternalError("client library summon: no readable 1024-element view \"weight\"");
    }
    FS_RETURN_IF_ERROR(s->End());
  }
  auto summon_end = [&](bool record) -> absl::Status {
    const auto t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::SummonedParams> s, c->Summon("", "", so));
    const auto t1 = Clock::now();
    FS_RETURN_IF_ERROR(s->End());
    const auto t2 = Clock::now();
    if (record) out->RecordSummonEnd(t0, t1, t2);
    return absl::OkStatus();
  };
  auto pings = [&](bool record) { return PingPair(stub.get(), record, out); };
  FS_RETURN_IF_ERROR(Alternate(warmup, 0, summon_end, pings));
  const int64_t maps_before = c->segment_map_calls();
  FS_RETURN_IF_ERROR(Alternate(0, iters, summon_end, pings));
  *map_calls = c->segment_map_calls() - maps_before;
  *retained = RetainedDeletedMappings(d.tag());
  std::unique_ptr<client::SummonedParams> held;
  FS_RETURN_IF_ERROR(MeasureTransitions(
      stub.get(), warmup, iters,
      [&]() -> absl::Status {
        FS_ASSIGN_OR_RETURN(held, c->Summon("", "", so, std::move(held)));
        return absl::OkStatus();
      },
      out));
  FS_RETURN_IF_ERROR(held->End());
  return c->Leave();
}

absl::Status LatencyWithRawStubs(const DaemonProcess& d, int warmup, int iters,
                                 LatencySamples* out) {
  std::shared_ptr<grpc::Channel> channel = MakeChannel(d.address());
  std::unique_ptr<Stub> stub = v1::ShardService::NewStub(channel);
  FS_ASSIGN_OR_RETURN(uint64_t session, RawJoin(stub.get(), "latency-raw", 1, 0));
  const v1::Caller caller = MakeCaller("latency-raw", 0, session);
  FS_RETURN_IF_ERROR(RawRegister(stub.get(), caller, 1024).status());
  auto summon_end = [&](bool record) -> absl::Status {
    const auto t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(v1::SummonResponse r,
                        RawSummon(stub.get(), caller, false, std::chrono::seconds(10)));
    const auto t1 = Clock::now();
    FS_RETURN_IF_ERROR(RawEnd(stub.get(), caller, r.summon(), std::chrono::seconds(10)));
    const auto t2 = Clock::now();
    if (record) out->RecordSummonEnd(t0, t1, t2);
    return absl::OkStatus();
  };
  auto pings = [&](bool record) { return PingPair(stub.get(), record, out); };
  FS_RETURN_IF_ERROR(Alternate(warmup, iters, summon_end, pings));
  uint64_t held = 0;
  FS_RETURN_IF_ERROR(MeasureTransitions(
      stub.get(), warmup, iters,
      [&]() -> absl::Status {
        FS_ASSIGN_OR_RETURN(v1::SummonResponse r,
                            RawSummon(stub.get(), caller, false, std::chrono::seconds(10), held));
        held = r.summon();
        return absl::OkStatus();
      },
      out));
  FS_RETURN_IF_ERROR(RawEnd(stub.get(), caller, held, std::chrono::seconds(10)));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, std::chrono::seconds(10));
  v1::LeaveRequest req;
  *req.mutable_caller() = caller;
  v1::LeaveResponse resp;
  if (grpc::Status s = stub->Leave(&ctx, req, &resp); !s.ok()) return RpcError("Leave", s);
  return absl::OkStatus();
}

absl::Status RunLatency(const DaemonProcess& d, int warmup, int iters) {
  std::printf(
      "\n## Latency: Summon(writeback=false)+End of a 4096-byte unit (1 rank) vs Ping; "
      "%d iterations after %d warm-up, A/B alternated\n",
      iters, warmup);
  std::printf(
      "# lib: flatshard::client (RPC + segment mapping + views; Summons on its transition "
      "lane); Pings on a raw stub, same socket. lib-unary: the same with "
      "FLATSHARD_NO_TRANSITION_LANE=1 (unary Summons). raw: raw stubs (unary), one channel "
      "for all.\n");
  std::printf(
      "# targets: p50 <= 1.2x, p99 <= 1.5x the base (per RPC: base Ping; the pair: two "
      "Pings). load: %s\n",
      LoadAverage().c_str());
  LatencySamples lib, lib_unary, raw;
  int64_t map_calls = 0, unary_map_calls = 0;
  std::pair<int64_t, int64_t> retained, unary_retained;
  FS_RETURN_IF_ERROR(LatencyWithClientLibrary(d, warmup, iters, &lib, &map_calls, &retained));
  ::setenv("FLATSHARD_NO_TRANSITION_LANE", "1", 1);  // read when the Client connects
  const absl::Status unary =
      LatencyWithClientLibrary(d, warmup, iters, &lib_unary, &unary_map_calls, &unary_retained);
  ::unsetenv("FLATSHARD_NO_TRANSITION_LANE");
  FS_RETURN_IF_ERROR(unary);
  FS_RETURN_IF_ERROR(LatencyWithRawStubs(d, warmup, iters, &raw));
  PrintLatencyHeader();
  PrintLatency("lib", lib, 4096);
  PrintLatency("lib-unary", lib_unary, 4096);
  PrintLatency("raw", raw, 4096);
  for (const auto& [variant, samples] : {std::pair<const char*, const LatencySamples*>{"lib", &lib},
                                         {"lib_unary", &lib_unary},
                                         {"raw", &raw}}) {
    PrintFigure(absl::StrCat("latency.", variant, ".summon_end.p50"),
                Percentile(samples->summon_end, 50), "us");
    PrintFigure(absl::StrCat("latency.", variant, ".summon_end.p99"),
                Percentile(samples->summon_end, 99), "us");
    PrintFigure(absl::StrCat("latency.", variant, ".transition.p50_over_ping"),
                Percentile(samples->transition, 50) / Percentile(samples->transition_ping, 50),
                "x");
    PrintFigure(absl::StrCat("latency.", variant, ".ping.p50"), Percentile(samples->ping, 50), "us",
                /*lower_is_better=*/true, /*context=*/true);
  }
  std::printf(
      "# lib: %" PRId64
      " segment mmaps in %d measured summons (%.2f per summon); after "
      "them the client still mapped %" PRId64 " unlinked daemon segments (%" PRId64 " bytes)\n",
      map_calls, iters, static_cast<double>(map_calls) / iters, retained.first, retained.second);
  return absl::OkStatus();
}

// ---- 2. Unshard bandwidth ---------------------------------------------------------------------

// Single-thread copies on this process: the baseline and the pieces of the daemon's path.
struct CopyBaseline {
  double memcpy_us = 0;           // touched src and dst (the baseline)
  double memcpy_fresh_us = 0;     // dst freshly mmapped (page faults included)
  double shm_create_us = 0;       // ShmSegment::Create (shm_open + ftruncate + fallocate + mmap)
  double shm_create_copy_us = 0;  // Create + memcpy into it: what the daemon does per summon
};

// An anonymous private mapping, unmapped on destruction.
class AnonBuffer {
 public:
  explicit AnonBuffer(size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~AnonBuffer() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  AnonBuffer(const AnonBuffer&) = delete;
  AnonBuffer& operator=(const AnonBuffer&) = delete;
  char* data() const { return data_; }

 private:
  size_t bytes_;
  char* data_;
};

absl::StatusOr<CopyBaseline> MeasureCopies(size_t bytes, const std::string& prefix) {
  constexpr int kReps = 5;
  CopyBaseline out;
  std::vector<double> t_memcpy, t_fresh, t_create, t_create_copy;
  {
    AnonBuffer src(bytes), dst(bytes);
    if (src.data() == nullptr || dst.data() == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map 2 x ", bytes, " bytes"));
    }
    std::memset(src.data(), 1, bytes);
    std::memset(dst.data(), 2, bytes);
    std::memcpy(dst.data(), src.data(), bytes);  // warm-up
    for (int i = 0; i < kReps; ++i) {
      const auto t0 = Clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      t_memcpy.push_back(MicrosSince(t0, Clock::now()));
    }
    for (int i = 0; i < kReps; ++i) {
      const auto t0 = Clock::now();
      AnonBuffer fresh(bytes);
      if (fresh.data() == nullptr) return absl::ResourceExhaustedError("cannot map a fresh buffer");
      std::memcpy(fresh.data(), src.data(), bytes);
      t_fresh.push_back(MicrosSince(t0, Clock::now()));
    }
    for (int i = 0; i < kReps; ++i) {
      const auto t0 = Clock::now();
      FS_ASSIGN_OR_RETURN(ShmSegment seg, ShmSegment::Create(MakeSegmentName(prefix), bytes));
      t_create.push_back(MicrosSince(t0, Clock::now()));
    }
    for (int i = 0; i < kReps; ++i) {
      const auto t0 = Clock::now();
      FS_ASSIGN_OR_RETURN(ShmSegment seg, ShmSegment::Create(MakeSegmentName(prefix), bytes));
      std::memcpy(seg.data(), src.data(), bytes);
      t_create_copy.push_back(MicrosSince(t0, Clock::now()));
    }
  }
  out.memcpy_us = Median(t_memcpy);
  out.memcpy_fresh_us = Median(t_fresh);
  out.shm_create_us = Median(t_create);
  out.shm_create_copy_us = Median(t_create_copy);
  return out;
}

struct RankTimes {
  // [phase][rep]: phase 0 = writeback=false, 1 = writeback=true.
  std::vector<double> summon[2];
  std::vector<double> end[2];
  // Rank 0 only: the most /dev/shm/<prefix>.* held once every rank's End returned, per phase.
  int64_t resident_after_end[2] = {0, 0};
};

// Bytes of /dev/shm/<prefix>.* actually allocated (st_blocks), i.e. resident in tmpfs.
int64_t ShmResidentBytes(const std::string& prefix) {
  int64_t total = 0;
  for (const fs::path& p : SegmentsWithPrefix(prefix)) {
    struct stat st;
    if (::stat(p.c_str(), &st) == 0) total += static_cast<int64_t>(st.st_blocks) * 512;
  }
  return total;
}

// `segment` with what was being done and the daemon's segments that exist now, on error.
absl::StatusOr<ShmSegment> Annotate(absl::StatusOr<ShmSegment> segment, absl::string_view what,
                                    const std::string& prefix) {
  if (segment.ok()) return segment;
  std::vector<std::string> names;
  for (const fs::path& p : SegmentsWithPrefix(prefix)) names.push_back(p.filename().string());
  std::sort(names.begin(), names.end());
  return absl::Status(segment.status().code(),
                      absl::StrCat(what, ": ", segment.status().message(), " (/dev/shm has ",
                                   absl::StrJoin(names, " "), ")"));
}

// A rank's part: join, register, fill its shard with rank+1, then for each phase warm-up + reps
// of (barrier, Summon + map, barrier, End, barrier). Every rank checks the gathered values on its
// first rep (untimed): both ends of each shard range hold shard rank + 1.
void RankMain(const std::string& address, const std::string& prefix, const std::string& group,
              int world, int rank, int64_t numel, int reps, std::barrier<>* sync,
              std::atomic<bool>* failed, RankTimes* times, absl::Status* status) {
  auto run = [&]() -> absl::Status {
    std::shared_ptr<grpc::Channel> channel = MakeChannel(address, rank);
    std::unique_ptr<Stub> stub = v1::ShardService::NewStub(channel);
    FS_ASSIGN_OR_RETURN(uint64_t session, RawJoin(stub.get(), group, world, rank));
    const v1::Caller caller = MakeCaller(group, rank, session);
    FS_ASSIGN_OR_RETURN(v1::RegisterModuleResponse reg, RawRegister(stub.get(), caller, numel));
    const v1::PlanUnit& unit = reg.plan().units(0);
    {
      const v1::MemoryHandle& h = reg.shards(0).shard();
      FS_ASSIGN_OR_RETURN(ShmSegment shard,
                          Annotate(ShmSegment::Open(h.segment(), h.segment_bytes(), true),
                                   "mapping the rank's shard", prefix));
      float* p = reinterpret_cast<float*>(static_cast<char*>(shard.data()) + h.offset());
      std::fill(p, p + h.bytes() / sizeof(float), static_cast<float>(rank + 1));
    }
    const auto deadline = std::chrono::seconds(300);
    for (int phase = 0; phase < 2; ++phase) {
      const bool writeback = phase == 1;
      for (int rep = 0; rep < 1 + reps; ++rep) {
        sync->arrive_and_wait();
        if (failed->load()) return absl::OkStatus();
        const auto t0 = Clock::now();
        FS_ASSIGN_OR_RETURN(v1::SummonResponse r,
                            RawSummon(stub.get(), caller, writeback, deadline));
        if (r.units_size() != 1) {
          return absl::InternalError(absl::StrCat("Summon returned ", r.units_size(), " views"));
        }
        const v1::MemoryHandle& h = r.units(0).params();
        FS_ASSIGN_OR_RETURN(ShmSegment view,
                            Annotate(ShmSegment::Open(h.segment(), h.segment_bytes(), writeback),
                                     absl::StrCat("mapping the view of summon ", r.summon(),
                                                  " (writeback=", writeback, ", rep ", rep, ")"),
                                     prefix));
        const auto t1 = Clock::now();
        if (rep == 0) {
          // Shard k holds k+1: check both ends of every shard's unpadded range.
          const float* p =
              reinterpret_cast<const float*>(static_cast<const char*>(view.data()) + h.offset());
          for (int64_t k = 0; k < world; ++k) {
            const int64_t first = k * unit.shard_numel();
            const int64_t last = std::min(unit.numel(), (k + 1) * unit.shard_numel()) - 1;
            for (int64_t i : {first, last}) {
              if (i < 0 || i >= unit.numel()) continue;
              if (p[i] != static_cast<float>(k + 1)) {
                return absl::InternalError(absl::StrCat("rank ", rank, " writeback=", writeback,
                                                        ": element ", i, " is ", p[i], ", want ",
                                                        k + 1));
              }
            }
          }
        }
        sync->arrive_and_wait();
        if (failed->load()) return absl::OkStatus();
        const auto t2 = Clock::now();
        FS_RETURN_IF_ERROR(RawEnd(stub.get(), caller, r.summon(), deadline));
        const auto t3 = Clock::now();
        if (rep > 0) {
          times->summon[phase].push_back(MicrosSince(t0, t1));
          times->end[phase].push_back(MicrosSince(t2, t3));
        }
        sync->arrive_and_wait();  // every End returned: what does the daemon still hold?
        if (failed->load()) return absl::OkStatus();
        if (rank == 0) {
          times->resident_after_end[phase] =
              std::max(times->resident_after_end[phase], ShmResidentBytes(prefix));
        }
      }
    }
    grpc::ClientContext ctx;
    SetDeadline(&ctx, std::chrono::seconds(10));
    v1::LeaveRequest req;
    *req.mutable_caller() = caller;
    v1::LeaveResponse resp;
    if (grpc::Status s = stub->Leave(&ctx, req, &resp); !s.ok()) return RpcError("Leave", s);
    return absl::OkStatus();
  };
  *status = run();
  if (!status->ok()) failed->store(true);
  // Leaving the barrier lets the other ranks pass; they see `failed` and stop.
  sync->arrive_and_drop();
}

void PrintBandwidthRow(int world, absl::string_view op, int64_t size, double time_us,
                       double memcpy_us, double bus_factor, absl::string_view note) {
  const double algbw = static_cast<double>(size) / (time_us * 1e3);  // GB/s
  std::printf("%5d  %-22s %12" PRId64 " %12.1f %11.2f %11.2f %9.2f  %s\n", world,
              std::string(op).c_str(), size, time_us, algbw, algbw * bus_factor,
              time_us / memcpy_us, std::string(note).c_str());
}

// Shrinks `bytes` (halving) until the peak need fits /dev/shm and available memory.
int64_t FitBytes(int64_t bytes, int num_worlds, int max_world) {
  struct statvfs sv;
  const int64_t shm_free =
      ::statvfs("/dev/shm", &sv) == 0 ? static_cast<int64_t>(sv.f_bavail) * sv.f_frsize : -1;
  const int64_t mem_free = MemAvailableBytes();
  // Peak, with 10% slack: the shards of every world size (1x each: a group's registration
  // outlives its sessions) plus a private copy per rank (writeback=true); the memcpy baseline
  // (3x: src, dst, a fresh dst or segment) runs while the earlier world sizes' shards exist.
  auto need_shm = [&](int64_t b) { return b * (num_worlds + max_world) * 11 / 10; };
  auto need_mem = [&](int64_t b) {
    return std::max(need_shm(b), b * (num_worlds - 1 + 3) * 11 / 10);
  };
  int64_t fit = bytes;
  while (fit > (int64_t{1} << 20) && ((shm_free >= 0 && need_shm(fit) > shm_free) ||
                                      (mem_free >= 0 && need_mem(fit) > mem_free))) {
    fit /= 2;
  }
  if (fit != bytes) {
    std::printf("# NOTE: --bytes %" PRId64 " needs about %" PRId64
                " bytes of /dev/shm (free %" PRId64 ") and %" PRId64
                " of memory (available %" PRId64 "): shrunk to %" PRId64 "\n",
                bytes, need_shm(bytes), shm_free, need_mem(bytes), mem_free, fit);
  }
  return fit;
}

absl::Status RunUnshard(const DaemonProcess& d, int64_t bytes, const std::vector<int>& worlds,
                        int reps) {
  const int max_world = *std::max_element(worlds.begin(), worlds.end());
  bytes = FitBytes(bytes, static_cast<int>(worlds.size()), max_world);
  const int64_t numel = bytes / static_cast<int64_t>(sizeof(float));
  if (numel < max_world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--bytes ", bytes, " is fewer than ", max_world, " float32 elements"));
  }
  std::printf("\n## Unshard: one unit of %" PRId64 " float32 (%" PRId64
              " bytes), all ranks local "
              "(threads, one channel each); median of %d reps after 1 warm-up; time = max over "
              "ranks of (Summon RPC + mmap of the returned segment)\n",
              numel, numel * 4, reps);
  std::printf(
      "# busbw = algbw * (n-1)/n; vs_memcpy = time / single-thread memcpy of the same "
      "bytes (target <= 1.20 for writeback=0). load: %s\n",
      LoadAverage().c_str());
  std::printf("%5s  %-22s %12s %12s %11s %11s %9s  %s\n", "#n", "op", "size", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "vs_memcpy", "note");
  int64_t shard_bytes = ShmResidentBytes(d.tag());  // the latency part's
  for (int world : worlds) {
    // The baseline first, while the daemon holds nothing of this world size.
    FS_ASSIGN_OR_RETURN(CopyBaseline base, MeasureCopies(static_cast<size_t>(numel) * 4, d.tag()));
    const int64_t size = numel * 4;
    PrintBandwidthRow(world, "memcpy 1-thread", size, base.memcpy_us, base.memcpy_us, 1.0,
                      "baseline: touched buffers");
    PrintFigure(absl::StrCat("unshard.n", world, ".memcpy"), base.memcpy_us, "us",
                /*lower_is_better=*/true, /*context=*/true);
    PrintBandwidthRow(world, "memcpy fresh dst", size, base.memcpy_fresh_us, base.memcpy_us, 1.0,
                      "context: + page faults of a new anonymous dst");
    PrintBandwidthRow(world, "shm create", size, base.shm_create_us, base.memcpy_us, 1.0,
                      "context: shm_open+ftruncate+fallocate+mmap");
    PrintBandwidthRow(world, "shm create+memcpy", size, base.shm_create_copy_us, base.memcpy_us,
                      1.0, "context: the daemon's per-summon work on 1 thread");

    const std::string group = absl::StrCat("unshard", world);
    std::barrier<> sync(world);
    std::atomic<bool> failed{false};
    std::vector<RankTimes> times(world);
    std::vector<absl::Status> status(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back(RankMain, d.address(), d.tag(), group, world, r, numel, reps, &sync,
                           &failed, &times[r], &status[r]);
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      if (!status[r].ok()) {
        return absl::Status(status[r].code(), absl::StrCat("unshard world_size=", world, ": rank ",
                                                           r, ": ", status[r].message()));
      }
    }
    const double bus = static_cast<double>(world - 1) / world;
    shard_bytes += size;  // registrations outlive their sessions: the shards stay
    for (int phase = 0; phase < 2; ++phase) {
      std::vector<double> summon_max, end_max;
      for (int rep = 0; rep < reps; ++rep) {
        double s = 0, e = 0;
        for (int r = 0; r < world; ++r) {
          s = std::max(s, times[r].summon[phase][rep]);
          e = std::max(e, times[r].end[phase][rep]);
        }
        summon_max.push_back(s);
        end_max.push_back(e);
      }
      const double summon_us = Median(summon_max), end_us = Median(end_max);
      std::string reps_text;
      for (double v : summon_max)
        absl::StrAppend(&reps_text, reps_text.empty() ? "" : " ", static_cast<int64_t>(v));
      const std::string figure = absl::StrCat("unshard.n", world, ".wb", phase);
      PrintFigure(figure + ".summon", summon_us, "us");
      PrintFigure(figure + ".end", end_us, "us");
      if (phase == 0) {
        const double ratio = summon_us / base.memcpy_us;
        PrintBandwidthRow(world, "summon writeback=0", size, summon_us, base.memcpy_us, bus,
                          absl::StrCat("one shared copy; target <= 1.20: ",
                                       ratio <= 1.2 ? "ok" : "MISS", "; reps(us): ", reps_text));
        PrintBandwidthRow(
            world, "end writeback=0", size, end_us, base.memcpy_us, bus,
            absl::StrCat("reshard; daemon shm after End: ", times[0].resident_after_end[0] >> 20,
                         " MiB (shards: ", shard_bytes >> 20, " MiB)"));
      } else {
        PrintBandwidthRow(world, "summon writeback=1", size, summon_us, base.memcpy_us, bus,
                          absl::StrCat("a private copy per rank (", world, " x ", size,
                                       " bytes written); reps(us): ", reps_text));
        PrintBandwidthRow(world, "end writeback=1", size, end_us, base.memcpy_us, bus,
                          absl::StrCat("write back own ranges; daemon shm after End: ",
                                       times[0].resident_after_end[1] >> 20,
                                       " MiB (shards: ", shard_bytes >> 20, " MiB)"));
      }
    }
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

// ---- 3. Commit and writeback End --------------------------------------------------------------

struct CommitSamples {
  std::vector<double> commit;
  std::vector<double> wb_summon, wb_end, wb_summon_end;  // Summon(writeback=true), its End
  int64_t map_calls = 0;                                 // the client's mmaps while measured
};

// One rank (a group of its own on `d`, the client library): registers one unit of `numel`
// float32, then warm-up + iters of (a) Commit after writing one element of its shard (an
// optimizer step's in-place update) and (b) Summon(writeback=true), one element written, End
// (the End writes back and commits), alternated A/B, B/A.
absl::Status CommitRows(const DaemonProcess& d, const std::string& group, int64_t numel, int warmup,
                        int iters, CommitSamples* out) {
  client::ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(300);
  FS_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c, client::Client::Connect(options));
  FS_RETURN_IF_ERROR(c->Join(group, 1, 0, "bench"));
  FS_ASSIGN_OR_RETURN(client::RegisteredModule model,
                      c->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros));
  FS_ASSIGN_OR_RETURN(client::ShardViews shards, c->GetShardViews(""));
  if (shards.units().size() != 1 || shards.units()[0].data == nullptr) {
    return absl::InternalError("GetShardViews: want one unit with a mapped shard");
  }
  float* shard = static_cast<float*>(shards.units()[0].data);
  float step = 0;
  uint64_t want_generation = model.generation;
  auto commit = [&](bool record) -> absl::Status {
    shard[0] = ++step;
    const auto t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(uint64_t generation, c->Commit(""));
    const auto t1 = Clock::now();
    if (generation != ++want_generation) {
      return absl::InternalError(
          absl::StrCat("Commit returned generation ", generation, ", want ", want_generation));
    }
    if (record) out->commit.push_back(MicrosSince(t0, t1));
    return absl::OkStatus();
  };
  client::SummonOptions wb;
  wb.writeback = true;
  auto summon_end = [&](bool record) -> absl::Status {
    const auto t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::SummonedParams> s, c->Summon("", "", wb));
    const auto t1 = Clock::now();
    const client::ParamView* w = s->Find("weight");
    if (w == nullptr || !w->writable || w->data == nullptr) {
      return absl::InternalError("Summon(writeback=true): no writable view \"weight\"");
    }
    static_cast<float*>(w->data)[0] = ++step;
    const auto t2 = Clock::now();
    FS_RETURN_IF_ERROR(s->End());
    const auto t3 = Clock::now();
    ++want_generation;  // an agreed writeback End commits
    if (record) {
      out->wb_summon.push_back(MicrosSince(t0, t1));
      out->wb_end.push_back(MicrosSince(t2, t3));
      out->wb_summon_end.push_back(MicrosSince(t0, t1) + MicrosSince(t2, t3));
    }
    return absl::OkStatus();
  };
  FS_RETURN_IF_ERROR(Alternate(warmup, 0, commit, summon_end));
  const int64_t maps_before = c->segment_map_calls();
  FS_RETURN_IF_ERROR(Alternate(0, iters, commit, summon_end));
  out->map_calls = c->segment_map_calls() - maps_before;
  // The shard must hold the last step written (by the last Commit or writeback End).
  FS_ASSIGN_OR_RETURN(client::ShardViews after, c->GetShardViews(""));
  if (after.generation() != want_generation) {
    return absl::InternalError(absl::StrCat("the shards hold generation ", after.generation(),
                                            ", want ", want_generation));
  }
  return c->Leave();
}

void PrintCommitRow(absl::string_view daemon, absl::string_view op, int64_t size,
                    const std::vector<double>& v, absl::string_view note) {
  std::printf("%-10s %-20s %10" PRId64 " %8zu %10.1f %10.1f  %s\n", std::string(daemon).c_str(),
              std::string(op).c_str(), size, v.size(), Percentile(v, 50), Percentile(v, 99),
              std::string(note).c_str());
}

// Commit and writeback End on `d` (no --state_dir) and on a second daemon of the same binary
// with --state_dir (each commit writes fsynced records there: what a restartable deployment
// pays), one rank each, for every unit size.
absl::Status RunCommit(const DaemonProcess& d, const std::vector<int64_t>& sizes, int warmup,
                       int iters) {
  DaemonProcess durable;
  const bench::ScopedStopOnSignal stop_on_signal(&durable);
  const std::string tag = absl::StrCat(d.tag(), "s");
  std::string root = absl::GetFlag(FLAGS_state_dir_root);
  if (root.empty()) root = fs::temp_directory_path().string();
  const fs::path state_dir = fs::path(root) / absl::StrCat(tag, "-state");
  std::error_code ec;
  fs::remove_all(state_dir, ec);
  durable.RemoveOnStop(state_dir);
  FS_RETURN_IF_ERROR(
      durable.Start(absl::GetFlag(FLAGS_flatshardd), tag, {"--state_dir=" + state_dir.string()}));
  std::printf(
      "\n## Commit and writeback End: one rank, one unit, client library; Commit (after writing "
      "one element of the shard) alternated A/B, B/A with Summon(writeback=true) + one element "
      "written + End; %d iterations after %d warm-up (units over 1 MiB: %d after %d)\n",
      iters, warmup, ScaledIters(iters, int64_t{1} << 21, 5),
      ScaledIters(warmup, int64_t{1} << 21, 1));
  std::printf(
      "# daemons: 'plain' = the daemon above (no --state_dir); 'state_dir' = the same binary "
      "with --state_dir=%s (fsynced records per commit). load: %s\n",
      state_dir.c_str(), LoadAverage().c_str());
  std::printf("%-10s %-20s %10s %8s %10s %10s  %s\n", "#daemon", "op", "size", "samples", "p50(us)",
              "p99(us)", "note");
  for (int64_t size : sizes) {
    const int64_t numel = std::max<int64_t>(1, size / static_cast<int64_t>(sizeof(float)));
    const int64_t unit_bytes = numel * static_cast<int64_t>(sizeof(float));
    const int n = ScaledIters(iters, unit_bytes, 5);
    const int w = ScaledIters(warmup, unit_bytes, 1);
    for (const auto& [name, daemon] :
         {std::pair<const char*, const DaemonProcess*>{"plain", &d}, {"state_dir", &durable}}) {
      CommitSamples s;
      FS_RETURN_IF_ERROR(
          CommitRows(*daemon, absl::StrCat("commit-", name, "-", unit_bytes), numel, w, n, &s));
      PrintCommitRow(name, "Commit", unit_bytes, s.commit, "");
      PrintCommitRow(name, "Summon writeback=1", unit_bytes, s.wb_summon, "");
      PrintCommitRow(name, "End writeback=1", unit_bytes, s.wb_end, "writes back and commits");
      PrintCommitRow(name, "Summon+End wb=1", unit_bytes, s.wb_summon_end,
                     absl::StrCat("client mmaps in measured summons: ", s.map_calls));
      const std::string figure = absl::StrCat("commit.", daemon == &d ? "plain" : "statedir", ".",
                                              bench::SizeName(unit_bytes));
      PrintFigure(figure + ".commit.p50", Percentile(s.commit, 50), "us");
      PrintFigure(figure + ".commit.p99", Percentile(s.commit, 99), "us");
      PrintFigure(figure + ".wb_end.p50", Percentile(s.wb_end, 50), "us");
      PrintFigure(figure + ".wb_summon_end.p50", Percentile(s.wb_summon_end, 50), "us");
      std::fflush(stdout);
    }
  }
  durable.Stop();
  return absl::OkStatus();
}

absl::Status Run() {
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int reps = absl::GetFlag(FLAGS_reps);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  if (iters < 1 || warmup < 0 || reps < 1) {
    return absl::InvalidArgumentError("want --iters >= 1, --warmup >= 0 and --reps >= 1");
  }
  if (bytes < 4) return absl::InvalidArgumentError("--bytes must be at least 4");
  FS_ASSIGN_OR_RETURN(
      std::vector<int> worlds,
      bench::ParseCounts("world_sizes", absl::GetFlag(FLAGS_world_sizes), 2, 64, "world size"));

  FS_ASSIGN_OR_RETURN(std::vector<int64_t> commit_sizes,
                      bench::ParseByteSizes("commit_bytes", absl::GetFlag(FLAGS_commit_bytes), 4,
                                            int64_t{1} << 40));
  const int commit_iters = absl::GetFlag(FLAGS_commit_iters);
  if (commit_iters < 1) return absl::InvalidArgumentError("want --commit_iters >= 1");

  DaemonProcess daemon;
  const bench::ScopedStopOnSignal stop_on_signal(&daemon);
  const std::string tag = absl::StrCat("fsbench", ::getpid());
  std::vector<std::string> flags;
  if (absl::GetFlag(FLAGS_unshard_state_dir)) {
    std::string root = absl::GetFlag(FLAGS_state_dir_root);
    if (root.empty()) root = fs::temp_directory_path().string();
    const fs::path state_dir = fs::path(root) / absl::StrCat(tag, "-unshard-state");
    std::error_code ec;
    fs::remove_all(state_dir, ec);
    daemon.RemoveOnStop(state_dir);
    flags.push_back("--state_dir=" + state_dir.string());
  }
  FS_RETURN_IF_ERROR(daemon.Start(absl::GetFlag(FLAGS_flatshardd), tag, flags));
  std::printf(
      "# flatshard daemon benchmark: flatshardd at %s, segments /dev/shm/%s.*; %s; %u "
      "hardware threads; load %s\n",
      daemon.address().c_str(), daemon.tag().c_str(),
      flags.empty() ? "--ephemeral" : flags[0].c_str(), std::thread::hardware_concurrency(),
      LoadAverage().c_str());
  absl::Status status = absl::OkStatus();
  if (!absl::GetFlag(FLAGS_skip_latency)) status = RunLatency(daemon, warmup, iters);
  std::fflush(stdout);
  if (status.ok() && !absl::GetFlag(FLAGS_skip_unshard)) {
    status = RunUnshard(daemon, bytes, worlds, reps);
  }
  std::fflush(stdout);
  if (status.ok() && !absl::GetFlag(FLAGS_skip_commit)) {
    status = RunCommit(daemon, commit_sizes, warmup, commit_iters);
  }
  std::fflush(stdout);
  if (!status.ok()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a dying daemon: let it go
    const std::string exit_note = daemon.ExitNote();
    // The benchmark stops the daemon only after this point: whatever ended it came from outside.
    status = absl::Status(
        status.code(), absl::StrCat(status.message(), exit_note.empty() ? "" : "\n-- flatshardd ",
                                    exit_note, exit_note.empty() ? "" : " while the benchmark ran",
                                    "\n-- flatshardd log tail:\n", daemon.LogTail()));
  }
  daemon.Stop();
  return status;
}

}  // namespace
}  // namespace flatshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "flatshardd benchmarks: Summon+End latency vs Ping, unshard bandwidth vs memcpy, Commit "
      "and writeback End latency.\n"
      "Usage: flatshard_daemon_benchmark [--bytes N] [--iters N] [--world_sizes 2,4] "
      "[--warmup N] [--reps N] [--commit_bytes 4096,64MiB] [--commit_iters N] "
      "[--state_dir_root DIR] [--skip_latency] [--skip_unshard] [--skip_commit] "
      "[--unshard_state_dir] "
      "[--flatshardd PATH]");
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts, so that every thread inherits the mask.
  flatshard::bench::StartSignalThread("flatshard_daemon_benchmark");
  const absl::Status status = flatshard::Run();
  // Interrupted: the signal thread stops the daemons and exits; the errors that caused here
  // are not worth reporting.
  while (flatshard::bench::Interrupted()) pause();
  if (!status.ok()) {
    std::fprintf(stderr, "flatshard_daemon_benchmark: FAILED: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
