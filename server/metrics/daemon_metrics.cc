#include "server/metrics/daemon_metrics.h"

#include <string>
#include <vector>

#include "common/config.h"

// The source commit, set by server/metrics/CMakeLists.txt at configure time.
#ifndef FS_GIT_COMMIT
#define FS_GIT_COMMIT "unknown"
#endif
#ifndef FS_BUILD_TYPE
#define FS_BUILD_TYPE "unknown"
#endif

namespace flatshard::metrics {
namespace {

// Checkpoints run from well under a second to hours.
std::vector<double> CheckpointBuckets() {
  return {0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200};
}

}  // namespace

const DaemonMetrics& GetDaemonMetrics() {
  static const DaemonMetrics* const m = [] {
    Registry& r = DefaultRegistry();
    auto* metrics = new DaemonMetrics{
        r.AddCounter("flatshard_rpcs_total",
                     "ShardService RPCs answered, by method and status code", {"method", "code"}),
        r.AddHistogram("flatshard_rpc_latency_seconds",
                       "ShardService RPC latency from arrival to answer (collective RPCs include "
                       "the wait for the other ranks)",
                       {"method"}),
        r.AddCounter("flatshard_collectives_total",
                     "Collective ops completed, one per local rank, by kind and status code",
                     {"kind", "status"}),
        r.AddCounter("flatshard_collective_bytes_total",
                     "Bytes of successful collective ops per local rank (the op's larger "
                     "buffer), by backend",
                     {"backend"}),
        r.AddCounter("flatshard_aborted_collectives_total",
                     "Groups whose collectives were aborted (first sticky error: a failed op, "
                     "the watchdog, a dead peer, Abort or shutdown)"),
        r.AddGauge("flatshard_memory_bytes", "Committed shard-store bytes by buffer kind",
                   {"kind"}),
        r.AddGauge("flatshard_memory_limit_bytes",
                   "The shard store's memory limit in bytes (--memory_limit_mib; 0: none)"),
        r.AddGauge("flatshard_memory_buffers", "Live shared-memory buffers (segments)"),
        r.AddGauge("flatshard_groups", "Groups this daemon knows"),
        r.AddGauge("flatshard_clients", "Joined ranks with a live session (lease)"),
        r.AddGauge("flatshard_gpu_memory_bytes",
                   "A GPU pool's device memory: reserved (slabs), in_use (buffers), limit "
                   "(--gpu_memory_limit_mib; 0: none)",
                   {"device", "state"}),
        r.AddGauge("flatshard_build_info",
                   "Always 1; the labels name the daemon's version, source commit and CMake "
                   "build type",
                   {"version", "commit", "build_type"}),
        r.AddCounter("flatshard_commits_total",
                     "Commit calls answered, one per rank, by status code", {"code"}),
        r.AddHistogram("flatshard_commit_duration_seconds",
                       "Commit from arrival to answer (includes the wait for the other ranks "
                       "and the copy into the committed buffers)",
                       {}),
        r.AddCounter("flatshard_commit_bytes_total",
                     "Bytes successful commits copied into the committed buffers (shards and "
                     "optimizer state), per rank"),
        r.AddCounter("flatshard_checkpoints_total",
                     "Checkpoint operations ended, by kind (save, load, import) and status code",
                     {"kind", "code"}),
        r.AddCounter("flatshard_checkpoint_bytes_total",
                     "Tensor bytes (every rank's shards and optimizer state) of successful "
                     "checkpoints, as their reports say",
                     {"kind"}),
        r.AddHistogram("flatshard_checkpoint_duration_seconds",
                       "Checkpoint operations from the request to the result, by kind", {"kind"},
                       CheckpointBuckets()),
    };
    metrics->build_info.WithLabels({FS_VERSION_STRING, FS_GIT_COMMIT, FS_BUILD_TYPE}).Set(1);
    return metrics;
  }();
  return *m;
}

void RecordRpc(absl::string_view method, absl::StatusCode code, absl::Duration latency) {
  const DaemonMetrics& m = GetDaemonMetrics();
  const std::string code_name = absl::StatusCodeToString(code);
  m.rpcs.WithLabels({method, code_name}).Increment();
  m.rpc_latency.WithLabels({method}).Observe(absl::ToDoubleSeconds(latency));
}

void RecordCollective(absl::string_view kind, absl::StatusCode code, absl::string_view backend,
                      uint64_t bytes) {
  const DaemonMetrics& m = GetDaemonMetrics();
  const std::string code_name = absl::StatusCodeToString(code);
  m.collectives.WithLabels({kind, code_name}).Increment();
  if (code == absl::StatusCode::kOk) {
    m.collective_bytes.WithLabels({backend}).Increment(static_cast<double>(bytes));
  }
}

void RecordAbortedCollectives() {
  GetDaemonMetrics().aborted_collectives.WithLabels({}).Increment();
}

void RecordCommit(absl::StatusCode code, absl::Duration duration) {
  const DaemonMetrics& m = GetDaemonMetrics();
  m.commits.WithLabels({absl::StatusCodeToString(code)}).Increment();
  m.commit_duration.WithLabels({}).Observe(absl::ToDoubleSeconds(duration));
}

void RecordCommitBytes(int64_t bytes) {
  GetDaemonMetrics().commit_bytes.WithLabels({}).Increment(static_cast<double>(bytes));
}

void RecordCheckpoint(absl::string_view kind, absl::StatusCode code, absl::Duration duration,
                      int64_t bytes) {
  const DaemonMetrics& m = GetDaemonMetrics();
  m.checkpoints.WithLabels({kind, absl::StatusCodeToString(code)}).Increment();
  m.checkpoint_duration.WithLabels({kind}).Observe(absl::ToDoubleSeconds(duration));
  if (code == absl::StatusCode::kOk) {
    m.checkpoint_bytes.WithLabels({kind}).Increment(static_cast<double>(bytes));
  }
}

}  // namespace flatshard::metrics
