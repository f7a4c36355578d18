#include "server/metrics/daemon_metrics.h"

#include <string>

namespace flatshard::metrics {

const DaemonMetrics& GetDaemonMetrics() {
  static const DaemonMetrics* const m = [] {
    Registry& r = DefaultRegistry();
    return new DaemonMetrics{
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
    };
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

}  // namespace flatshard::metrics
