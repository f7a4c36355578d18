// flatshard's multi-daemon unshard against its baselines (never part of the default test run).
//
//   build/tests/bench/flatshard_multi_daemon_benchmark [--bytes N] [--daemons 2,4] [--iters N]
//       [--warmup N] [--transfer_bytes N] [--ucx_tls TLS] [--skip_mpi] [--skip_ucx_perftest]
//       [--skip_flatshard] [--skip_transfer] [--ranks_per_node 1,2]
//       [--ops allgather,reduce_scatter] [--link_rate 10gbit [--link_delay 50us]]
//
// --link_rate: every daemon in an emulated node of its own (tests/testing/emulated_links.h:
// a network namespace on a tbf-shaped veth link), its ranks too (setns), Open MPI's ranks of
// that node as well (mpirun in node 0, an `ip netns exec` rsh agent for the others); a "line
// rate" row per table. --ops reduce_scatter: ReduceScatterGrads' Finish (the gradient written
// before the barrier) against MPI_Reduce_scatter. --ranks_per_node: rank r on daemon
// r / ranks_per_node, MPI with as many processes per node; with several ranks per node the
// flatshard row runs again on daemons with --ucx_hierarchical=false (the flat ring, same run):
// "flatshard flat ring" and the ratio flat/hierarchical (--flat_ring_baseline=false: not).
//
// Several flatshardd processes on this host stand in for nodes: each has its own Unix socket,
// segment prefix, node name and PeerService port (127.0.0.1, picked free here); bytes move
// between them over UCX. Measured side by side in one run (DESIGN.md "Performance targets"):
//
// 1. All-gather. For each D in --daemons: D daemons, one trainer process per daemon (fork;
//    flatshard::client, joining with daemon 0's peer address as coordinator). Every rank
//    registers one unit of --bytes float32 (default 1 GiB) and fills its shard with rank + 1;
//    then --warmup + --iters iterations of (barrier, Summon(writeback=false), End) timed on
//    every rank. An iteration's time is the max over ranks; rows show the median over
//    iterations of Summon alone (the unshard, what DESIGN's target compares) and of Summon+End.
//    Baseline: `mpirun --oversubscribe -np D flatshard_mpi_allgather_baseline` with the same
//    total bytes, iterations and method (max over ranks, median), launched by this benchmark
//    right before the daemons start. Target: flatshard Summon <= 1.10x MPI_Allgather.
// 2. Daemon-to-daemon transfer. 2 daemons x 1 rank, one unit of 2 x --transfer_bytes (default
//    2 x 64 MiB) summoned with rank0_only=true: rank 1's shard travels to rank 0's daemon over
//    UCX. Time: max over ranks of Summon (median). Baselines: `ucx_perftest -t tag_bw -s
//    <transfer_bytes>` between a server and a client process on 127.0.0.1 (average time per
//    message over max(--iters, 10) after --warmup), twice: with `-e` (endpoints with peer error
//    handling, as the daemons create theirs; with UCX 1.13 that limits one host to tcp/lo) and
//    plain (UCX's default: shared memory and CMA). The ratio column is against the run whose
//    UCX endpoint configuration equals the daemons'; the note gives both ratios. All of them
//    run with the same UCX_TLS: unset (UCX's default selection) unless --ucx_tls is given.
//
// Headline figures are also printed as "# FIGURE name value unit lower|higher" lines
// (scripts/bench_ab.sh). Tables use nccl-tests columns: size (bytes gathered: the unit),
// time, algbw = size/time and busbw = algbw * (n-1)/n. The transports each side used are
// reported: Open MPI's PML and BTL (from its verbose selection output), UCX's endpoint
// configurations (ep_cfg lines at UCX_LOG_LEVEL=info, from ucx_perftest's output and from the
// daemons' logs).
//
// Every daemon, trainer, mpirun and ucx_perftest process is a child of this one and is ended
// on every exit path: normal, error, SIGINT/SIGTERM (a signal thread cleans up), and this
// process's death (PR_SET_PDEATHSIG). Daemon segments (/dev/shm/<prefix>.*) and temporary
// directories are removed (after a SIGKILL of this process only its log directories
// /tmp/fsmdbench<pid>* remain: the daemons remove their own segments on the SIGTERM they get);
// this run's /dev/shm entries still there at the end are reported. Exits non-zero when a part
// failed (the other parts still run).
//
// Known issue this benchmark exposes (hence the guard): a summon right after End may find the
// daemon's kept buffer still referenced and get a fresh segment, which the client library then
// keeps mapped after the daemon unlinks it (a unit's worth of /dev/shm each time). A rank stops
// with RESOURCE_EXHAUSTED before that fills /dev/shm; --settle_ms pauses (untimed) after End.

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"
#include "tests/bench/emulated_nodes.h"
#include "tests/bench/multi_daemon_mpi.h"
#include "tests/bench/multi_daemon_processes.h"
#include "tests/bench/multi_daemon_ucx_perftest.h"
#include "tests/testing/emulated_links.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30,
          "bytes of the all-gathered unit (float32; rounded down to whole elements)");
ABSL_FLAG(std::vector<std::string>, daemons, std::vector<std::string>({"2", "4"}),
          "numbers of daemons (one rank each) of the all-gather rows, comma-separated");
ABSL_FLAG(int32_t, iters, 20, "measured iterations of every row");
ABSL_FLAG(int32_t, warmup, 3, "warm-up iterations of every row");
ABSL_FLAG(int64_t, transfer_bytes, int64_t{64} << 20,
          "bytes of the daemon-to-daemon transfer (rank 1's shard; the unit is twice that)");
ABSL_FLAG(std::string, ucx_tls, "",
          "UCX_TLS for the daemons and ucx_perftest alike (empty: unset, UCX's default "
          "selection; an UCX_TLS already in the environment is passed on to both)");
ABSL_FLAG(std::string, ucx_error_handling, "auto",
          "the daemons' --ucx_error_handling: 'auto' (their default) or 'peer' (TCP loopback "
          "between daemons on one host, UCX reports dead peers), or 'none' (shared memory "
          "between daemons on one host, dead peers found by heartbeats)");
ABSL_FLAG(int32_t, settle_ms, 0,
          "untimed pause of every rank after each End (0: none; summons back to back as in a "
          "training loop)");
ABSL_FLAG(bool, skip_mpi, false, "skip the MPI_Allgather baseline");
ABSL_FLAG(bool, skip_ucx_perftest, false, "skip the ucx_perftest tag_bw baseline");
ABSL_FLAG(bool, skip_flatshard, false,
          "skip every flatshard measurement (run only the baselines, e.g. with a flatshardd "
          "that has no multi-daemon groups)");
ABSL_FLAG(bool, skip_transfer, false, "skip the 2-daemon transfer rows (both sides)");
ABSL_FLAG(absl::Duration, part_timeout, absl::Seconds(600),
          "limit on each part (one row's processes); past it they are killed and the part fails");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");
ABSL_FLAG(std::string, mpirun, FS_MPIEXEC, "mpirun (empty: none; the MPI rows are skipped)");
ABSL_FLAG(std::string, mpi_baseline, FS_MPI_BASELINE,
          "the flatshard_mpi_allgather_baseline binary (empty: not built)");
ABSL_FLAG(std::string, ucx_perftest, "ucx_perftest", "the ucx_perftest binary (PATH is searched)");
ABSL_FLAG(std::string, link_rate, "",
          "emulated nodes (README \"Multi-node links\"): every daemon, its ranks and the MPI "
          "ranks of its node in a network namespace of their own, joined by veth links shaped "
          "to this rate per direction (tc tbf: 10gbit, 25gbit, 800mbit); empty: daemons on "
          "this host's loopback. Needs root and iproute2");
ABSL_FLAG(std::string, link_delay, "50us",
          "one-way latency of every emulated link (tc netem; where the kernel has no "
          "sch_netem the links run without it and the header says so)");
ABSL_FLAG(std::vector<std::string>, ranks_per_node, std::vector<std::string>({"1"}),
          "ranks per daemon (node) of the collective rows, comma-separated (rank r on daemon "
          "r / ranks_per_node; MPI: the same number of processes per node)");
ABSL_FLAG(bool, flat_ring_baseline, true,
          "rows with several ranks per daemon run flatshard twice: hierarchical (the daemons' "
          "default) and the flat ring (--ucx_hierarchical=false), and print the ratio");
ABSL_FLAG(std::vector<std::string>, ops, std::vector<std::string>({"allgather"}),
          "collectives of the rows: allgather (Summon vs MPI_Allgather) and/or reduce_scatter "
          "(ReduceScatterGrads vs MPI_Reduce_scatter)");

namespace flatshard {
namespace {

namespace fs = std::filesystem;
// The daemons' --ucx_hierarchical (false for a row's flat-ring baseline run).
bool g_ucx_hierarchical = true;
using bench::BenchDaemon;
using bench::Clock;
using bench::ExecLoggedChild;
using bench::ExecVectors;
using bench::Median;
using bench::MicrosSince;

using bench::md::children;
using bench::md::Children;
using bench::md::FindInPath;
using bench::md::g_interrupted;
using bench::md::JoinOrNone;
using bench::md::KillTool;
using bench::md::MpiResult;
using bench::md::RunMpi;
using bench::md::RunUcxPerftest;
using bench::md::SignalThread;
using bench::md::SpawnTool;
using bench::md::UcxEndpointConfigs;
using bench::md::UcxPerfResult;
using bench::md::WaitTool;

constexpr char kToken[] = "bench";

// The daemons of one part, registered for the signal thread; stopped (segments removed) when
// destroyed.
class DaemonSet {
 public:
  DaemonSet() = default;
  DaemonSet(const DaemonSet&) = delete;
  DaemonSet& operator=(const DaemonSet&) = delete;
  ~DaemonSet() {
    Children& c = children();
    absl::MutexLock lock(&c.mu);
    for (auto& d : daemons_) {
      c.daemons.erase(d.get());
      d->Stop();
    }
  }

  // Starts daemon `index` ("node<index>") with a fresh peer port; a few tries, since a port
  // picked free may be taken before the daemon binds it.
  absl::Status StartOne(const std::string& binary, const std::string& tag_base, int index,
                        const std::vector<std::string>& env,
                        const testing::EmulatedLinks* links = nullptr) {
    if (links != nullptr) return StartOnNode(binary, tag_base, index, env, *links);
    absl::Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      const int port = bench::PickFreeLoopbackPort();
      if (port <= 0) return absl::InternalError("no free TCP port on 127.0.0.1");
      auto d = std::make_unique<BenchDaemon>();
      {
        Children& c = children();
        absl::MutexLock lock(&c.mu);
        c.daemons.insert(d.get());
      }
      const std::string peer = absl::StrCat("127.0.0.1:", port);
      last = d->Start(binary, absl::StrCat(tag_base, "n", index, "a", attempt),
                      {"--peer_address=" + peer, absl::StrCat("--node_name=node", index),
                       "--ucx_error_handling=" + absl::GetFlag(FLAGS_ucx_error_handling),
                       absl::StrCat("--ucx_hierarchical=", g_ucx_hierarchical)},
                      env, port);
      if (last.ok()) {
        daemons_.push_back(std::move(d));
        peer_addresses_.push_back(peer);
        return absl::OkStatus();
      }
      Children& c = children();
      absl::MutexLock lock(&c.mu);
      c.daemons.erase(d.get());
      d->Stop();
    }
    return absl::Status(last.code(), absl::StrCat("daemon ", index, ": ", last.message()));
  }

  // Daemon `index` in emulated node `index` (bench::StartDaemonOnNode: UCX on the node's
  // link only, UCX_TLS=tcp unless --ucx_tls).
  absl::Status StartOnNode(const std::string& binary, const std::string& tag_base, int index,
                           std::vector<std::string> env, const testing::EmulatedLinks& links) {
    auto d = std::make_unique<BenchDaemon>();
    {
      Children& c = children();
      absl::MutexLock lock(&c.mu);
      c.daemons.insert(d.get());
    }
    absl::StatusOr<std::string> peer = bench::StartDaemonOnNode(
        *d, binary, absl::StrCat(tag_base, "n", index, "l"), index,
        {absl::StrCat("--node_name=node", index),
         "--ucx_error_handling=" + absl::GetFlag(FLAGS_ucx_error_handling),
         absl::StrCat("--ucx_hierarchical=", g_ucx_hierarchical)},
        std::move(env), links, /*keep_tls=*/!absl::GetFlag(FLAGS_ucx_tls).empty());
    if (!peer.ok()) {
      Children& c = children();
      absl::MutexLock lock(&c.mu);
      c.daemons.erase(d.get());
      return peer.status();
    }
    daemons_.push_back(std::move(d));
    peer_addresses_.push_back(*std::move(peer));
    return absl::OkStatus();
  }

  size_t size() const { return daemons_.size(); }
  BenchDaemon& operator[](size_t i) { return *daemons_[i]; }
  const std::string& peer_address(size_t i) const { return peer_addresses_[i]; }

  // "" while every daemon runs; which one ended and how otherwise.
  std::string ExitNotes() {
    std::string out;
    for (size_t i = 0; i < daemons_.size(); ++i) {
      if (std::string note = daemons_[i]->ExitNote(); !note.empty()) {
        absl::StrAppend(&out, out.empty() ? "" : "; ", "daemon ", i, " ", note);
      }
    }
    return out;
  }

  std::string LogTails() const {
    std::string out;
    for (size_t i = 0; i < daemons_.size(); ++i) {
      absl::StrAppend(&out, "\n-- daemon ", i, " log tail:\n",
                      bench::Tail(daemons_[i]->Log(), 2000));
    }
    return out;
  }

 private:
  std::vector<std::unique_ptr<BenchDaemon>> daemons_;
  std::vector<std::string> peer_addresses_;
};

// ---- Ranks -------------------------------------------------------------------------------------

// Client::Join with the coordinator argument of multi-daemon groups, where this client library
// has it (detected at compile time, so that this file builds before and after it landed).
template <typename C>
absl::Status JoinWithCoordinator(C& c, const std::string& group, int world, int rank,
                                 const std::string& coordinator) {
  if constexpr (requires(C & x) { x.Join(group, world, rank, group, coordinator); }) {
    return c.Join(group, world, rank, kToken, coordinator);
  } else {
    return absl::FailedPreconditionError(
        "this client library's Join has no coordinator argument: multi-daemon groups are not "
        "built in (run with --skip_flatshard for the baselines alone)");
  }
}

// Mappings of /dev/shm/<prefix>.* in this process whose segment was unlinked: bytes.
int64_t RetainedDeletedBytes(const std::string& prefix_base) {
  std::ifstream in("/proc/self/maps");
  std::string line;
  int64_t bytes = 0;
  const std::string needle = "/dev/shm/" + prefix_base;
  while (std::getline(in, line)) {
    if (line.find(needle) == std::string::npos || line.find("(deleted)") == std::string::npos) {
      continue;
    }
    uint64_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64, &lo, &hi) == 2) {
      bytes += static_cast<int64_t>(hi - lo);
    }
  }
  return bytes;
}

struct RankJob {
  std::string address;      // this rank's daemon
  std::string coordinator;  // daemon 0's peer address
  std::string group;
  std::string segment_prefix_base;  // of every daemon of the part
  int world = 0;
  int rank = 0;
  int64_t numel = 0;
  bool rank0_only = false;
  int warmup = 0;
  int iters = 0;
  absl::Duration settle;       // untimed pause after each End
  int64_t retained_limit = 0;  // most unlinked daemon shm this rank may keep mapped
  absl::Duration call_timeout;
  std::string log_path;          // the rank's stdout and stderr (the client library logs there)
  std::string netns;             // the emulated node's namespace the rank runs in ("": this one's)
  std::string op = "allgather";  // or "reduce_scatter"
};

// The rank's side of the parent's pipes: "B\n" arrives at a barrier and waits for 'G' (go);
// 'X' or EOF aborts. Results: "T <summon_us> <end_us>\n" per measured iteration, "M <mmaps>
// <retained bytes>\n", then "D\n"; an error: "F <message>\n".
class RankPipe {
 public:
  RankPipe(int up, int down) : up_(up), down_(down) {}
  absl::Status Send(absl::string_view line) {
    std::string s(line);
    s.push_back('\n');
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::write(up_, s.data() + off, s.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return absl::UnavailableError("the benchmark's pipe closed");
      off += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }
  absl::Status Barrier() {
    FS_RETURN_IF_ERROR(Send("B"));
    char c = 0;
    ssize_t n = 0;
    while ((n = ::read(down_, &c, 1)) < 0 && errno == EINTR) {
    }
    if (n == 1 && c == 'G') return absl::OkStatus();
    return absl::AbortedError("aborted by the benchmark (another rank or a daemon failed)");
  }

 private:
  int up_, down_;
};

// The reduce-scatter rows: every iteration, untimed, BeginReduceScatter and the gradient
// (rank + 1 everywhere) written; then the barrier and Finish, timed (the collective alone, as
// MPI_Reduce_scatter's buffers are ready before its clock starts). The first
// iteration's gradient shard is checked: the sum over ranks everywhere.
absl::Status ReduceScatterBody(const RankJob& job, client::Client& c, RankPipe& pipe) {
  std::vector<std::pair<double, double>> times;
  const float want = static_cast<float>(job.world) * static_cast<float>(job.world + 1) / 2;
  for (int i = 0; i < job.warmup + job.iters; ++i) {
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::PendingReduceScatter> p,
                        c.BeginReduceScatter("", 0, client::ReduceOp::kSum, false));
    std::fill_n(static_cast<float*>(p->data()), p->numel(), static_cast<float>(job.rank + 1));
    FS_RETURN_IF_ERROR(pipe.Barrier());
    const auto t0 = Clock::now();
    FS_RETURN_IF_ERROR(p->Finish());
    const auto t1 = Clock::now();
    if (i >= job.warmup) times.emplace_back(MicrosSince(t0, t1), 0.0);
    if (i == 0) {
      FS_ASSIGN_OR_RETURN(client::ShardViews views, c.GetShardViews(""));
      const client::UnitShardView& u = views.units()[0];
      const float* g = static_cast<const float*>(u.grad);
      if (g == nullptr) return absl::InternalError("no gradient shard after the reduce-scatter");
      for (int64_t e : {int64_t{0}, u.shard_numel - 1}) {
        if (g[e] != want) {
          return absl::InternalError(
              absl::StrCat("reduced gradient element ", e, " is ", g[e], ", want ", want));
        }
      }
    }
  }
  FS_RETURN_IF_ERROR(c.Leave());
  for (const auto& [us, zero] : times) {
    FS_RETURN_IF_ERROR(pipe.Send(absl::StrCat("T ", us, " ", zero)));
  }
  FS_RETURN_IF_ERROR(pipe.Send("M 0 0"));
  return pipe.Send("D");
}

absl::Status RankBody(const RankJob& job, RankPipe& pipe) {
  client::ClientOptions options;
  options.address = job.address;
  options.call_timeout = job.call_timeout;
  options.join_timeout = absl::Seconds(120);
  FS_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c, client::Client::Connect(options));
  FS_RETURN_IF_ERROR(JoinWithCoordinator(*c, job.group, job.world, job.rank, job.coordinator));
  FS_ASSIGN_OR_RETURN(client::RegisteredModule model,
                      c->Register("", bench::ManifestJson(job.numel), bench::kPolicyJson,
                                  client::InitMode::kZeros));
  if (model.shards.units().size() != 1) {
    return absl::InternalError(
        absl::StrCat("expected one shard of one unit, got ", model.shards.units().size()));
  }
  const client::UnitShardView& shard = model.shards.units()[0];
  if (shard.dtype != DType::kFloat32 || shard.data == nullptr) {
    return absl::InternalError("the shard is not a mapped float32 buffer");
  }
  std::fill_n(static_cast<float*>(shard.data), shard.shard_numel, static_cast<float>(job.rank + 1));
  const int64_t shard_numel = shard.shard_numel;
  if (job.op == "reduce_scatter") return ReduceScatterBody(job, *c, pipe);

  client::SummonOptions so;
  so.writeback = false;
  so.rank0_only = job.rank0_only;
  std::vector<std::pair<double, double>> times;
  int64_t maps_before = 0;
  for (int i = 0; i < job.warmup + job.iters; ++i) {
    if (i == job.warmup) maps_before = c->segment_map_calls();
    FS_RETURN_IF_ERROR(pipe.Barrier());
    const auto t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::SummonedParams> s, c->Summon("", "", so));
    const auto t1 = Clock::now();
    const bool want_views = !job.rank0_only || job.rank == 0;
    if (s->has_views() != want_views) {
      return absl::InternalError(
          absl::StrCat("summon ", i, ": has_views() is ", s->has_views(), ", want ", want_views));
    }
    if (i == 0 && want_views) {
      // Shard k holds k + 1: check both ends of every shard's unpadded range.
      const client::ParamView* w = s->Find("weight");
      if (w == nullptr || w->numel != job.numel || w->data == nullptr) {
        return absl::InternalError("the summon has no view \"weight\" of the unit's size");
      }
      const float* p = static_cast<const float*>(w->data);
      for (int64_t k = 0; k < job.world; ++k) {
        const int64_t first = k * shard_numel;
        const int64_t last = std::min(job.numel, (k + 1) * shard_numel) - 1;
        for (int64_t e : {first, last}) {
          if (e < 0 || e >= job.numel) continue;
          if (p[e] != static_cast<float>(k + 1)) {
            return absl::InternalError(absl::StrCat("gathered element ", e, " is ", p[e], ", want ",
                                                    k + 1, " (shard ", k, ")"));
          }
        }
      }
    }
    const auto t2 = Clock::now();
    FS_RETURN_IF_ERROR(s->End());
    const auto t3 = Clock::now();
    if (i >= job.warmup) times.emplace_back(MicrosSince(t0, t1), MicrosSince(t2, t3));
    // The client library keeps every segment it mapped; a daemon that hands out a fresh
    // buffer (its kept one still referenced) makes it hold another unit's worth of unlinked
    // shm each time. Stop before that fills /dev/shm.
    const int64_t retained = RetainedDeletedBytes(job.segment_prefix_base);
    if (retained > job.retained_limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "after summon ", i, " this client still maps ", retained,
          " bytes of unlinked daemon segments (", c->segment_map_calls(),
          " segments mapped so far): the run would exhaust /dev/shm (try --settle_ms)"));
    }
    if (job.settle > absl::ZeroDuration()) absl::SleepFor(job.settle);
  }
  const int64_t maps = c->segment_map_calls() - maps_before;
  const int64_t retained = RetainedDeletedBytes(job.segment_prefix_base);
  FS_RETURN_IF_ERROR(c->Leave());
  for (const auto& [summon_us, end_us] : times) {
    FS_RETURN_IF_ERROR(pipe.Send(absl::StrCat("T ", summon_us, " ", end_us)));
  }
  FS_RETURN_IF_ERROR(pipe.Send(absl::StrCat("M ", maps, " ", retained)));
  return pipe.Send("D");
}

// In the forked child: runs the rank and exits (never returns).
[[noreturn]] void RankProcess(const RankJob& job, int up, int down) {
  RankPipe pipe(up, down);
  absl::Status st;
  if (!job.netns.empty()) {
    // The trainer on its node: its sockets (none but the daemon's Unix socket) in the node's
    // network namespace, as a trainer on that host.
    const std::string path = "/var/run/netns/" + job.netns;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
      st = absl::InternalError(absl::StrCat("entering ", path, ": ", std::strerror(errno)));
    }
    if (fd >= 0) ::close(fd);
  }
  if (st.ok()) st = RankBody(job, pipe);
  if (!st.ok()) {
    std::string msg(st.ToString());
    absl::StrReplaceAll({{"\n", " | "}}, &msg);
    (void)pipe.Send("F " + msg);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(st.ok() ? 0 : 1);
}

struct RankResult {
  std::vector<double> summon_us, end_us;
  int64_t maps = -1, retained = -1;
  bool done = false;
  std::string error;
  std::string buffer;  // partial line
  bool eof = false;
};

struct PartResult {
  std::vector<double> summon_max_us, summon_end_max_us;  // per measured iteration
  int64_t maps = 0, retained = 0;                        // summed over ranks
};

// Forks one rank per job, releases their barriers, collects their results. Every rank is
// reaped before this returns; on a failure (a rank's error, a rank or daemon dying, the
// deadline) the others are aborted (then killed).
absl::StatusOr<PartResult> RunRanks(const std::vector<RankJob>& jobs, DaemonSet& daemons,
                                    absl::Time deadline) {
  const int n = static_cast<int>(jobs.size());
  std::vector<int> up_read(n, -1), down_write(n, -1);
  std::vector<pid_t> pids;
  std::vector<RankResult> results(n);
  auto close_all = [&] {
    for (int& fd : up_read) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    for (int& fd : down_write) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  };
  // Kills and reaps every rank still running.
  auto end_ranks = [&](bool kill_now) {
    Children& c = children();
    if (!kill_now) {
      // Closing the pipes aborts ranks at their next barrier; give them a moment to leave.
      for (int& fd : down_write) {
        if (fd >= 0) ::close(fd);
        fd = -1;
      }
    }
    const absl::Time give_up = absl::Now() + (kill_now ? absl::ZeroDuration() : absl::Seconds(5));
    for (pid_t pid : pids) {
      while (absl::Now() < give_up && ::waitpid(pid, nullptr, WNOHANG) == 0) {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    absl::MutexLock lock(&c.mu);
    for (pid_t pid : pids) {
      if (c.ranks.erase(pid) > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
    close_all();
  };
  const pid_t parent = ::getpid();
  for (int r = 0; r < n; ++r) {
    int up[2], down[2];
    if (::pipe2(up, O_CLOEXEC) != 0 || ::pipe2(down, O_CLOEXEC) != 0) {
      end_ranks(true);
      return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    }
    Children& c = children();
    c.mu.Lock();  // registered before the signal thread could miss it
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int fork_errno = errno;
      c.mu.Unlock();
      ::close(up[0]), ::close(up[1]), ::close(down[0]), ::close(down[1]);
      end_ranks(true);
      return absl::InternalError(absl::StrCat("fork: ", std::strerror(fork_errno)));
    }
    if (pid == 0) {
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) _exit(126);
      // Only this rank's ends: a rank must see EOF when the parent closes its pipe.
      for (int fd : up_read) {
        if (fd >= 0) ::close(fd);
      }
      for (int fd : down_write) {
        if (fd >= 0) ::close(fd);
      }
      ::close(up[0]);
      ::close(down[1]);
      const int log_fd =
          ::open(jobs[r].log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (log_fd >= 0) {
        ::dup2(log_fd, STDOUT_FILENO);
        ::dup2(log_fd, STDERR_FILENO);
      }
      RankProcess(jobs[r], up[1], down[0]);
    }
    c.ranks.insert(pid);
    c.mu.Unlock();
    pids.push_back(pid);
    ::close(up[1]);
    ::close(down[0]);
    up_read[r] = up[0];
    down_write[r] = down[1];
  }

  std::string failure;
  int arrived = 0, finished = 0;
  auto broadcast = [&](char c) {
    for (int& fd : down_write) {
      if (fd >= 0 && ::write(fd, &c, 1) != 1) {
        ::close(fd);
        fd = -1;
      }
    }
  };
  while (finished < n && failure.empty()) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 0; r < n; ++r) {
      if (up_read[r] >= 0) {
        pfds.push_back({up_read[r], POLLIN, 0});
        who.push_back(r);
      }
    }
    const int ready = ::poll(pfds.data(), pfds.size(), 100);
    if (ready < 0 && errno != EINTR) {
      failure = absl::StrCat("poll: ", std::strerror(errno));
      break;
    }
    for (size_t i = 0; i < pfds.size() && ready > 0; ++i) {
      if ((pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const int r = who[i];
      RankResult& res = results[r];
      char buf[4096];
      const ssize_t got = ::read(up_read[r], buf, sizeof(buf));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        ::close(up_read[r]);
        up_read[r] = -1;
        res.eof = true;
        ++finished;
        if (!res.done && res.error.empty()) {
          int st = 0;
          const std::string how = ::waitpid(pids[r], &st, WNOHANG) == pids[r]
                                      ? bench::DescribeWaitStatus(st)
                                      : std::string("still running");
          res.error = absl::StrCat("exited without a result (", how, ")");
        }
        if (!res.error.empty() && failure.empty()) {
          failure = absl::StrCat("rank ", r, ": ", res.error);
        }
        continue;
      }
      res.buffer.append(buf, static_cast<size_t>(got));
      size_t nl;
      while ((nl = res.buffer.find('\n')) != std::string::npos) {
        const std::string line = res.buffer.substr(0, nl);
        res.buffer.erase(0, nl + 1);
        std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
        if (line == "B") {
          if (++arrived == n) {
            arrived = 0;
            broadcast('G');
          }
        } else if (f[0] == "T" && f.size() == 3) {
          double s = 0, e = 0;
          if (absl::SimpleAtod(f[1], &s) && absl::SimpleAtod(f[2], &e)) {
            res.summon_us.push_back(s);
            res.end_us.push_back(e);
          }
        } else if (f[0] == "M" && f.size() == 3) {
          if (!absl::SimpleAtoi(f[1], &res.maps) || !absl::SimpleAtoi(f[2], &res.retained)) {
            res.maps = res.retained = -1;
          }
        } else if (line == "D") {
          res.done = true;
        } else if (f[0] == "F") {
          res.error = line.substr(2);
          if (failure.empty()) failure = absl::StrCat("rank ", r, ": ", res.error);
        }
      }
    }
    if (failure.empty()) {
      if (std::string notes = daemons.ExitNotes(); !notes.empty()) {
        failure = absl::StrCat(notes, " while the ranks ran");
      } else if (absl::Now() > deadline) {
        failure = "the part ran past --part_timeout";
      }
    }
  }
  if (!failure.empty()) {
    broadcast('X');
    end_ranks(absl::Now() > deadline);
    for (int r = 0; r < n; ++r) {
      absl::StrAppend(&failure, "\n-- rank ", r, " log tail:\n",
                      bench::Tail(bench::ReadText(jobs[r].log_path), 1500));
    }
    return absl::InternalError(failure);
  }
  end_ranks(false);
  PartResult out;
  for (int r = 0; r < n; ++r) {
    if (results[r].summon_us.size() != static_cast<size_t>(jobs[r].iters)) {
      return absl::InternalError(absl::StrCat("rank ", r, " reported ", results[r].summon_us.size(),
                                              " iterations, want ", jobs[r].iters));
    }
    out.maps += results[r].maps;
    out.retained += results[r].retained;
  }
  for (int i = 0; i < jobs[0].iters; ++i) {
    double s = 0, se = 0;
    for (int r = 0; r < n; ++r) {
      s = std::max(s, results[r].summon_us[i]);
      se = std::max(se, results[r].summon_us[i] + results[r].end_us[i]);
    }
    out.summon_max_us.push_back(s);
    out.summon_end_max_us.push_back(se);
  }
  return out;
}

int64_t ShmFreeBytes() {
  struct statvfs sv;
  return ::statvfs("/dev/shm", &sv) == 0 ? static_cast<int64_t>(sv.f_bavail) * sv.f_frsize : -1;
}

struct FlatshardResult {
  PartResult part;
  std::set<std::string> ucx_cfg;  // the daemons' UCX endpoint configurations
  int64_t unit_bytes = 0;
};

// D daemons, one rank each, one unit of `numel` float32.
absl::StatusOr<FlatshardResult> RunFlatshard(int d, int64_t numel, bool rank0_only, int iters,
                                             int warmup, const std::vector<std::string>& env,
                                             const std::string& tag_base, const fs::path& dir,
                                             absl::Duration timeout, int rpn = 1,
                                             const std::string& op = "allgather",
                                             const testing::EmulatedLinks* links = nullptr) {
  const absl::Time deadline = absl::Now() + timeout;
  DaemonSet daemons;
  for (int i = 0; i < d; ++i) {
    FS_RETURN_IF_ERROR(daemons.StartOne(absl::GetFlag(FLAGS_flatshardd), tag_base, i, env, links));
  }
  std::vector<RankJob> jobs;
  const int world = d * rpn;
  for (int r = 0; r < world; ++r) {
    RankJob job;
    job.address = daemons[r / rpn].address();
    if (links != nullptr) job.netns = links->ns(r / rpn);
    job.op = op;
    job.coordinator = daemons.peer_address(0);
    job.group = absl::StrCat(rank0_only ? "transfer" : op, d, "x", rpn);
    job.segment_prefix_base = tag_base;
    job.world = world;
    job.rank = r;
    job.numel = numel;
    job.rank0_only = rank0_only;
    job.warmup = warmup;
    job.iters = iters;
    job.settle = absl::Milliseconds(absl::GetFlag(FLAGS_settle_ms));
    // A third of /dev/shm's free space, shared by the ranks, at most 4 units each.
    job.retained_limit = std::min(4 * numel * static_cast<int64_t>(sizeof(float)),
                                  std::max<int64_t>(ShmFreeBytes() / 3 / world, 0));
    job.call_timeout = std::max(absl::Seconds(30), deadline - absl::Now());
    job.log_path = (dir / absl::StrCat(job.group, "_rank", r, ".log")).string();
    jobs.push_back(job);
  }
  absl::StatusOr<PartResult> part = RunRanks(jobs, daemons, deadline);
  if (!part.ok()) {
    absl::SleepFor(absl::Milliseconds(200));  // a dying daemon: let it go
    const std::string notes = daemons.ExitNotes();
    return absl::Status(part.status().code(),
                        absl::StrCat(part.status().message(), notes.empty() ? "" : "; ", notes,
                                     daemons.LogTails()));
  }
  FlatshardResult out;
  out.part = *std::move(part);
  out.unit_bytes = numel * static_cast<int64_t>(sizeof(float));
  // UCX logs through stdio, which a daemon flushes when it exits: stop them, then read.
  for (size_t i = 0; i < daemons.size(); ++i) daemons[i].Stop();
  for (size_t i = 0; i < daemons.size(); ++i) {
    for (const std::string& cfg : UcxEndpointConfigs(daemons[i].Log())) out.ucx_cfg.insert(cfg);
  }
  return out;
}

// ---- Output ------------------------------------------------------------------------------------

void PrintHeader() {
  std::printf("%-4s %-26s %12s %12s %11s %11s %8s  %s\n", "#n", "impl", "size", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "ratio", "note");
}

// `ratio_to`: the baseline's time (0: none).
void PrintRow(int n, absl::string_view impl, int64_t size, double time_us, double bus_factor,
              double ratio_to, absl::string_view note) {
  const double algbw = static_cast<double>(size) / (time_us * 1e3);  // GB/s
  const std::string ratio = ratio_to > 0 ? absl::StrFormat("%.3f", time_us / ratio_to) : "-";
  std::printf("%-4d %-26s %12" PRId64 " %12.1f %11.3f %11.3f %8s  %s\n", n,
              std::string(impl).c_str(), size, time_us, algbw, algbw * bus_factor, ratio.c_str(),
              std::string(note).c_str());
}

std::string Millis(const std::vector<double>& us) {
  std::vector<std::string> parts;
  for (double v : us) parts.push_back(absl::StrFormat("%.1f", v / 1e3));
  return absl::StrJoin(parts, " ");
}

std::set<std::string> ShmEntries() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

absl::Status Run() {
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int64_t transfer_bytes = absl::GetFlag(FLAGS_transfer_bytes);
  const absl::Duration timeout = absl::GetFlag(FLAGS_part_timeout);
  if (iters < 1 || warmup < 0)
    return absl::InvalidArgumentError("want --iters >= 1, --warmup >= 0");
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("want --part_timeout > 0");
  FS_ASSIGN_OR_RETURN(
      std::vector<int> daemon_counts,
      bench::ParseCounts("daemons", absl::GetFlag(FLAGS_daemons), 2, 16, "number of daemons"));
  const int max_d = *std::max_element(daemon_counts.begin(), daemon_counts.end());
  if (bytes < int64_t{4} * max_d * 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--bytes ", bytes, " is too small"));
  }
  if (transfer_bytes < 4096) return absl::InvalidArgumentError("--transfer_bytes is too small");

  // Same UCX_TLS for the daemons and ucx_perftest; UCX's info log says what they picked.
  std::vector<std::string> ucx_env = {"UCX_LOG_LEVEL=info"};
  std::string tls = absl::GetFlag(FLAGS_ucx_tls);
  if (!tls.empty()) {
    ucx_env.push_back("UCX_TLS=" + tls);
  } else if (const char* e = std::getenv("UCX_TLS"); e != nullptr) {
    tls = e;  // inherited by both
  }
  const std::string tls_note = tls.empty() ? "unset (UCX default selection)" : tls;

  const std::string tag_base = absl::StrCat("fsmdbench", ::getpid());
  const fs::path dir = fs::temp_directory_path() / tag_base;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("mkdir ", dir.string(), ": ", ec.message()));
  {
    absl::MutexLock lock(&children().mu);
    children().temp_dir = dir;
  }
  struct RemoveDir {
    ~RemoveDir() {
      absl::MutexLock lock(&children().mu);
      std::error_code ec;
      fs::remove_all(children().temp_dir, ec);
      children().temp_dir.clear();
    }
  } remove_dir;
  const std::set<std::string> shm_before = ShmEntries();

  std::printf(
      "# flatshard multi-daemon benchmark: %u hardware threads; load %s; memory "
      "available %" PRId64 " MiB; /dev/shm free %" PRId64 " MiB\n",
      std::thread::hardware_concurrency(), bench::LoadAverage().c_str(),
      bench::MemAvailableBytes() >> 20, ShmFreeBytes() >> 20);
  std::printf(
      "# %d iterations after %d warm-up per row; time = median over iterations of the "
      "max over ranks; busbw = algbw * (n-1)/n; UCX_TLS: %s\n",
      iters, warmup, tls_note.c_str());
  std::fflush(stdout);

  std::vector<std::string> failures;
  auto fail = [&](absl::string_view part, const absl::Status& st) {
    if (st.code() == absl::StatusCode::kFailedPrecondition &&
        !absl::StartsWith(part, "flatshard")) {
      // A baseline tool is not installed: the row is skipped, not failed.
      std::printf("# SKIPPED %s: %s\n", std::string(part).c_str(),
                  std::string(st.message()).c_str());
      std::fflush(stdout);
      return;
    }
    std::printf("# FAILED %s: %s\n", std::string(part).c_str(), std::string(st.message()).c_str());
    std::fflush(stdout);
    failures.push_back(std::string(part));
  };
  std::vector<std::string> summary;
  const int64_t numel = bytes / static_cast<int64_t>(sizeof(float));

  FS_ASSIGN_OR_RETURN(std::vector<int> rpns,
                      bench::ParseCounts("ranks_per_node", absl::GetFlag(FLAGS_ranks_per_node), 1,
                                         8, "ranks per node"));
  const std::vector<std::string> ops = absl::GetFlag(FLAGS_ops);
  for (const std::string& op : ops) {
    if (op != "allgather" && op != "reduce_scatter") {
      return absl::InvalidArgumentError(
          absl::StrCat("--ops: \"", op, "\", want allgather or reduce_scatter"));
    }
  }
  const std::string link_rate = absl::GetFlag(FLAGS_link_rate);
  for (int d : daemon_counts) {
    std::unique_ptr<testing::EmulatedLinks> links;
    if (!link_rate.empty()) {
      testing::LinkOptions lo;
      lo.nodes = d;
      lo.rate = link_rate;
      lo.delay = absl::GetFlag(FLAGS_link_delay);
      absl::StatusOr<std::unique_ptr<testing::EmulatedLinks>> l =
          testing::EmulatedLinks::Create(lo);
      if (!l.ok()) {
        std::printf("# FAILED links n=%d: %s\n", d, std::string(l.status().message()).c_str());
        failures.push_back(absl::StrCat("links n=", d));
        continue;
      }
      links = *std::move(l);
      absl::MutexLock lock(&children().mu);
      children().links.insert(links.get());
    }
    struct Unregister {
      testing::EmulatedLinks* links;
      ~Unregister() {
        absl::MutexLock lock(&children().mu);
        children().links.erase(links);
      }
    } unregister{links.get()};
    if (links != nullptr) std::printf("\n# links: %s\n", links->Describe().c_str());
    // What the links carry without flatshard: one TCP stream per node to the next at once
    // (each link one out, one in, as a ring step), (d-1)/d of the unit each; median of 3.
    double tcp_us = 0;
    if (links != nullptr) {
      const int64_t per_link = bytes / d * (d - 1);
      const int64_t window = std::min<int64_t>(per_link, int64_t{64} << 20);
      std::vector<char> src(static_cast<size_t>(window), 1);
      std::vector<std::pair<int, int>> pairs;
      for (int i = 0; i < d; ++i) pairs.emplace_back(i, (i + 1) % d);
      std::vector<double> runs;
      for (int k = 0; k < 3; ++k) {
        runs.push_back(bench::TcpStreamsMs(links.get(), pairs, src.data(), per_link, window) * 1e3);
      }
      tcp_us = *std::min_element(runs.begin(), runs.end()) < 0 ? 0 : Median(runs);
      if (tcp_us == 0)
        fail(absl::StrCat("plain TCP n=", d), absl::InternalError("a stream failed"));
      std::printf(
          "# plain TCP, %d streams (node i -> i+1), %" PRId64 " bytes each: %s ms%s\n", d, per_link,
          Millis(runs).c_str(),
          tcp_us > 0 && links->rate_bits_per_s() > 0
              ? absl::StrFormat(" (median %.0f%% of line rate)",
                                100 * per_link * 8 / links->rate_bits_per_s() / (tcp_us / 1e6))
                    .c_str()
              : "");
    }
    for (int rpn : rpns) {
      for (const std::string& op : ops) {
        const bool ag = op == "allgather";
        const int world = d * rpn;
        // Whole elements per rank on both sides: the same bytes gathered (reduced).
        const int64_t row_numel = numel / world * world;
        const int64_t size = row_numel * static_cast<int64_t>(sizeof(float));
        const double bus = static_cast<double>(world - 1) / world;
        const std::string row = absl::StrCat(op, ".n", d, rpn > 1 ? absl::StrCat("x", rpn) : "");
        std::printf("\n## %s of %" PRId64
                    " bytes by %d ranks (%d daemons x %d ranks; MPI: %d "
                    "processes)%s\n",
                    ag ? "All-gather" : "Reduce-scatter", size, world, d, rpn, world,
                    links != nullptr ? " over the emulated links" : "");
        PrintHeader();
        std::fflush(stdout);
        const std::string mpi_call = ag ? "MPI_Allgather" : "MPI_Reduce_scatter";
        std::optional<MpiResult> mpi;
        if (!absl::GetFlag(FLAGS_skip_mpi)) {
          absl::StatusOr<MpiResult> m =
              RunMpi(absl::GetFlag(FLAGS_mpirun), absl::GetFlag(FLAGS_mpi_baseline), world, size,
                     iters, warmup, dir, timeout, op, rpn, links.get());
          if (m.ok()) {
            mpi = *m;
            const std::string note = absl::StrCat(
                mpi_call, "; pml ", m->pml, ", btl ", m->btl,
                m->single_copy.empty() ? "" : absl::StrCat(" (single copy: ", m->single_copy, ")"));
            PrintRow(world, "mpi " + mpi_call, m->bytes, m->median_s * 1e6, bus, 0, note);
            summary.push_back(absl::StrFormat("%s mpi   size=%d time_us=%.1f  (%s)", row, m->bytes,
                                              m->median_s * 1e6, note));
          } else {
            fail(absl::StrCat("mpi ", row), m.status());
          }
          std::fflush(stdout);
        }
        // The line rate: every node's link carries (d-1)/d of the unit in (all-gather) or out
        // (reduce-scatter) at least once.
        double line_us = 0;
        if (links != nullptr && links->rate_bits_per_s() > 0) {
          line_us = static_cast<double>(size) * (d - 1) / d * 8 / links->rate_bits_per_s() * 1e6;
          PrintRow(world, "line rate", size, line_us, bus, 0,
                   absl::StrCat("(d-1)/d of the unit over one ", link_rate, " link"));
        }
        if (tcp_us > 0) {
          PrintRow(world, "plain TCP", size, tcp_us, bus, 0,
                   absl::StrFormat("one stream per link, as iperf; %.0f%% of line rate",
                                   100 * line_us / tcp_us));
        }
        if (absl::GetFlag(FLAGS_skip_flatshard)) continue;
        absl::StatusOr<FlatshardResult> f =
            RunFlatshard(d, row_numel, false, iters, warmup, ucx_env, tag_base, dir, timeout, rpn,
                         op, links.get());
        if (!f.ok()) {
          fail(absl::StrCat("flatshard ", row), f.status());
          std::fflush(stdout);
          continue;
        }
        const double t = Median(f->part.summon_max_us);
        const double t_end = Median(f->part.summon_end_max_us);
        const double base = mpi ? mpi->median_s * 1e6 : 0;
        std::string verdict =
            base > 0 ? absl::StrCat("target <= 1.10: ", t / base <= 1.10 ? "ok" : "MISS")
                     : "no MPI baseline";
        if (line_us > 0) {
          absl::StrAppend(&verdict, absl::StrFormat("; %.0f%% of line rate (target >= 90%%)",
                                                    100 * line_us / t));
        }
        if (tcp_us > 0) {
          absl::StrAppend(&verdict, absl::StrFormat("; %.0f%% of plain TCP", 100 * tcp_us / t));
        }
        PrintRow(world, ag ? "flatshard Summon" : "flatshard ReduceScatter", size, t, bus, base,
                 absl::StrCat(ag ? "unshard, writeback=0; " : "Finish; ", verdict,
                              "; per iter (ms): ", Millis(f->part.summon_max_us)));
        // Several ranks per daemon: the flat ring in the same run, for the ratio.
        if (rpn > 1 && absl::GetFlag(FLAGS_flat_ring_baseline)) {
          g_ucx_hierarchical = false;
          absl::StatusOr<FlatshardResult> flat =
              RunFlatshard(d, row_numel, false, iters, warmup, ucx_env, tag_base, dir, timeout, rpn,
                           op, links.get());
          g_ucx_hierarchical = true;
          if (flat.ok()) {
            const double tf = Median(flat->part.summon_max_us);
            PrintRow(world, "flatshard flat ring", size, tf, bus, base,
                     absl::StrFormat("--ucx_hierarchical=false; hierarchical %.2fx faster "
                                     "(target >= 1.6); per iter (ms): %s",
                                     tf / t, Millis(flat->part.summon_max_us)));
            bench::PrintFigure(
                absl::StrCat(links != nullptr ? "links." : "", row, ".flat_over_hierarchical"),
                tf / t, "x", /*lower_is_better=*/false);
          } else {
            fail(absl::StrCat("flatshard flat ring ", row), flat.status());
          }
        }
        if (ag) {
          PrintRow(world, "flatshard Summon+End", size, t_end, bus, base,
                   absl::StrCat("mmaps in measured summons (all ranks): ", f->part.maps,
                                "; unlinked shm still mapped: ", f->part.retained >> 20, " MiB"));
        }
        std::printf("# %s daemons' UCX endpoints: %s\n", row.c_str(),
                    JoinOrNone(f->ucx_cfg).c_str());
        // The loopback rows keep their names (scripts/bench_ab.sh compares across builds).
        const bool classic = links == nullptr && ag && rpn == 1;
        bench::PrintFigure(classic ? absl::StrCat("allgather.n", d, ".summon")
                                   : absl::StrCat(links != nullptr ? "links." : "", row),
                           t, "us");
        if (classic) {
          bench::PrintFigure(absl::StrCat("allgather.n", d, ".summon_end"), t_end, "us");
        }
        summary.push_back(absl::StrFormat(
            "%s flatshard size=%d time_us=%.1f ratio/MPI=%s%s%s", row, size, t,
            base > 0 ? absl::StrFormat("%.3f", t / base) : "-",
            line_us > 0 ? absl::StrFormat(" line_rate_fraction=%.3f", line_us / t) : "",
            tcp_us > 0 ? absl::StrFormat(" plain_tcp_fraction=%.3f", tcp_us / t) : ""));
        std::fflush(stdout);
      }
    }
  }

  if (!link_rate.empty() && !absl::GetFlag(FLAGS_skip_transfer)) {
    std::printf(
        "\n# the daemon-to-daemon transfer rows run on loopback only: skipped with "
        "--link_rate\n");
  } else if (!absl::GetFlag(FLAGS_skip_transfer)) {
    const int64_t tnumel = transfer_bytes / static_cast<int64_t>(sizeof(float));
    const int64_t tsize = tnumel * static_cast<int64_t>(sizeof(float));
    std::printf("\n## Daemon-to-daemon transfer of %" PRId64
                " bytes (flatshard: 2 daemons x 1 rank, a unit of %" PRId64
                " bytes summoned rank0_only: rank 1's shard goes to rank 0's daemon over UCX; "
                "ucx_perftest tag_bw between two processes on 127.0.0.1). UCX_TLS: %s\n",
                tsize, 2 * tsize, tls_note.c_str());
    std::printf("# size = bytes moved between processes; busbw = algbw (point to point)\n");
    PrintHeader();
    std::fflush(stdout);
    // Two baselines: endpoints with error handling as the daemons create theirs (-e: the same
    // transports, the ratio's base when UCX picked the same for both), and UCX's plain default
    // (shared memory and CMA on one host), for context.
    struct UcxRow {
      const char* name;
      bool error_handling;
      std::optional<UcxPerfResult> result;
    };
    UcxRow ucx_rows[] = {{"ucx_perftest tag_bw -e", true, std::nullopt},
                         {"ucx_perftest tag_bw", false, std::nullopt}};
    if (!absl::GetFlag(FLAGS_skip_ucx_perftest)) {
      for (UcxRow& row : ucx_rows) {
        absl::StatusOr<UcxPerfResult> u =
            RunUcxPerftest(absl::GetFlag(FLAGS_ucx_perftest), tsize, std::max(iters, 10), warmup,
                           row.error_handling, ucx_env, dir, timeout);
        if (u.ok()) {
          row.result = *u;
          const std::string note = absl::StrCat(
              row.error_handling ? "endpoints with peer error handling (as remote daemons'); "
                                 : "plain endpoints; ",
              "average per message; UCX endpoints: client ", JoinOrNone(u->client_cfg), "; server ",
              JoinOrNone(u->server_cfg));
          PrintRow(2, row.name, tsize, u->time_us, 1.0, 0, note);
          summary.push_back(absl::StrFormat("transfer %s size=%d time_us=%.1f (%s)", row.name,
                                            tsize, u->time_us, note));
        } else {
          fail(row.name, u.status());
        }
        std::fflush(stdout);
      }
    }
    if (!absl::GetFlag(FLAGS_skip_flatshard)) {
      absl::StatusOr<FlatshardResult> f =
          RunFlatshard(2, 2 * tnumel, true, iters, warmup, ucx_env, tag_base, dir, timeout);
      if (f.ok()) {
        const double summon = Median(f->part.summon_max_us);
        // The ratio's base: the baseline whose endpoints used the daemons' transports.
        const UcxRow* same = nullptr;
        std::string ratios;
        for (const UcxRow& row : ucx_rows) {
          if (!row.result) continue;
          const bool same_tls = row.result->client_cfg == f->ucx_cfg;
          if (same_tls && same == nullptr) same = &row;
          absl::StrAppend(&ratios, ratios.empty() ? "" : ", ",
                          absl::StrFormat("%.3f vs %s (%s)", summon / row.result->time_us, row.name,
                                          same_tls ? "same UCX transports" : "other transports"));
        }
        PrintRow(2, "flatshard Summon rank0_only", tsize, summon, 1.0,
                 same != nullptr ? same->result->time_us : 0,
                 absl::StrCat("unit of ", 2 * tsize, " bytes; daemons' UCX endpoints: ",
                              JoinOrNone(f->ucx_cfg), "; ratios: ", ratios.empty() ? "-" : ratios,
                              "; per iter (ms): ", Millis(f->part.summon_max_us)));
        bench::PrintFigure("transfer.n2.summon", summon, "us");
        summary.push_back(absl::StrFormat("transfer flatshard size=%d time_us=%.1f ratios %s",
                                          tsize, summon, ratios.empty() ? "-" : ratios));
      } else {
        fail("flatshard transfer", f.status());
      }
      std::fflush(stdout);
    }
  }

  std::printf("\n## Summary\n");
  for (const std::string& s : summary) std::printf("# %s\n", s.c_str());
  // This run's: its daemons' segments and what its MPI and UCX processes create. Other new
  // entries belong to other processes on this host.
  std::vector<std::string> leftovers;
  int others = 0;
  for (const std::string& e : ShmEntries()) {
    if (shm_before.count(e) > 0) continue;
    if (absl::StartsWith(e, tag_base) || absl::StrContains(e, "vader") ||
        absl::StrContains(e, "ucx")) {
      leftovers.push_back(e);
    } else {
      ++others;
    }
  }
  std::printf(
      "# /dev/shm entries of this run still present: %s (new entries of other processes: "
      "%d)\n",
      leftovers.empty() ? "none" : absl::StrJoin(leftovers, " ").c_str(), others);
  std::fflush(stdout);
  if (!failures.empty()) {
    return absl::InternalError(absl::StrCat("failed: ", absl::StrJoin(failures, ", ")));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace flatshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "flatshard multi-daemon unshard vs MPI_Allgather, daemon-to-daemon transfer vs "
      "ucx_perftest.\nUsage: flatshard_multi_daemon_benchmark [--bytes N] [--daemons 2,4] "
      "[--iters N] [--warmup N] [--transfer_bytes N] [--ucx_tls TLS] [--skip_mpi] "
      "[--skip_ucx_perftest] [--skip_flatshard] [--skip_transfer]");
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts, so that every thread inherits the mask. No gRPC in this process:
  // the ranks are forked from it and start gRPC themselves.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A rank that died closes its pipe: writes to it must fail with EPIPE, not kill this process
  // (children exec'ing a tool get the default back).
  ::signal(SIGPIPE, SIG_IGN);
  std::thread(flatshard::SignalThread, signals).detach();
  const absl::Status status = flatshard::Run();
  while (flatshard::g_interrupted) pause();
  if (!status.ok()) {
    std::fprintf(stderr, "flatshard_multi_daemon_benchmark: FAILED: %s\n",
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
