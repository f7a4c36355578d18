#pragma once
// The daemon's metrics, registered in metrics::DefaultRegistry() on first use, and the
// helpers the service layer and the collective engine call when an RPC or a collective
// completes. Names and labels (README "Read the metrics"):
//   flatshard_rpcs_total{method,code}              counter, per answered ShardService RPC
//   flatshard_rpc_latency_seconds{method}          histogram, from arrival to answer
//   flatshard_collectives_total{kind,status}       counter, per rank and op (kind AllGather, ...)
//   flatshard_collective_bytes_total{backend}      counter, bytes of successful ops
//   flatshard_aborted_collectives_total            counter, groups whose collectives aborted
//   flatshard_memory_bytes{kind}                   gauge, ShardStore's committed bytes per kind
//   flatshard_memory_limit_bytes                   gauge, the limit (0: none)
//   flatshard_memory_buffers                       gauge, live shared-memory segments
//   flatshard_gpu_memory_bytes{device,state}       gauge, a GPU pool's reserved/in_use/limit
//   flatshard_groups                               gauge, groups this daemon knows
//   flatshard_clients                              gauge, joined ranks with a live session
//   flatshard_build_info{version,commit,build_type}  gauge, always 1
//   flatshard_commits_total{code}                  counter, per rank's answered Commit
//   flatshard_commit_duration_seconds              histogram, Commit from arrival to answer
//   flatshard_commit_bytes_total                   counter, bytes copied by successful commits
//   flatshard_checkpoints_total{kind,code}         counter, per save/load/import (kind)
//   flatshard_checkpoint_bytes_total{kind}         counter, tensor bytes of successful ones
//   flatshard_checkpoint_duration_seconds{kind}    histogram, from the request to the result
// (process_* metrics: process_metrics.h.) Thread-safe.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/metrics/registry.h"

namespace flatshard::metrics {

struct DaemonMetrics {
  CounterFamily& rpcs;
  HistogramFamily& rpc_latency;
  CounterFamily& collectives;
  CounterFamily& collective_bytes;
  CounterFamily& aborted_collectives;
  GaugeFamily& memory_bytes;
  GaugeFamily& memory_limit;
  GaugeFamily& memory_buffers;
  GaugeFamily& groups;
  GaugeFamily& clients;
  GaugeFamily& gpu_memory;
  GaugeFamily& build_info;
  CounterFamily& commits;
  HistogramFamily& commit_duration;
  CounterFamily& commit_bytes;
  CounterFamily& checkpoints;
  CounterFamily& checkpoint_bytes;
  HistogramFamily& checkpoint_duration;
};

// Registers every family (so a scrape shows them all, at 0, from the start).
const DaemonMetrics& GetDaemonMetrics();

// One answered RPC: `code` as "OK", "NOT_FOUND", ... and its latency.
void RecordRpc(absl::string_view method, absl::StatusCode code, absl::Duration latency);
// One rank's completed collective op on `backend` (the group's Communicator::backend_name():
// "inproc", "ucx", "nccl", "inproc+staging", "ucx+staging"); `bytes` count only when `code`
// is OK.
void RecordCollective(absl::string_view kind, absl::StatusCode code, absl::string_view backend,
                      uint64_t bytes);
// A group's collectives were aborted (its first sticky error).
void RecordAbortedCollectives();
// One rank's Commit answered with `code`, `duration` after it arrived.
void RecordCommit(absl::StatusCode code, absl::Duration duration);
// Bytes one rank's successful commit copied into its committed copies (shards and state).
void RecordCommitBytes(int64_t bytes);
// A checkpoint operation (`kind`: "save", "load" or "import") ended with `code` after
// `duration`; `bytes` count only when `code` is OK.
void RecordCheckpoint(absl::string_view kind, absl::StatusCode code, absl::Duration duration,
                      int64_t bytes);

}  // namespace flatshard::metrics
