#pragma once
// Daemon: owns and orders the parts of flatshardd: the ShardStore (memory), the GroupManager
// (groups, sessions, registrations), the gRPC server for trainers and operators (Unix socket,
// optional TCP, the standard health service) and, for multi-daemon groups, the PeerService on
// its own TCP port with the UCX backend. Shutdown fails pending waits, stops the server within a
// grace period, and removes the socket and every shared-memory segment. Thread-safe: Shutdown may
// be called from any thread, once or more.

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/access/tls_config.h"

namespace flatshard::gpu {
class DeviceContext;
}  // namespace flatshard::gpu

namespace flatshard::server {

class AdminServiceImpl;
class CheckpointPeerServiceImpl;
class GroupManager;
struct GroupManagerOptions;
class InstanceLock;
class DistributedPublish;
class Publisher;
class WeightsPeerClient;
class WeightsPeerServiceImpl;
class WeightsPuller;
class UcxWeightsLink;
class RequestWorkers;
class ShardServiceImpl;
class TransitionLaneService;
class WeightsServiceImpl;
class ShardStore;
namespace access {
class AccessControl;
class UnixSocketAcceptor;
}  // namespace access
namespace peer {
class PeerServiceImpl;
}
namespace state {
class StateDir;
}
}  // namespace flatshard::server
namespace flatshard::metrics {
class MetricsServer;
}  // namespace flatshard::metrics
namespace flatshard::server {

struct DaemonConfig {
  std::string socket_path = "/run/flatshard/flatshardd.sock";
  std::string tcp_address;  // e.g. "127.0.0.1:7450"; empty: Unix socket only
  std::string segment_prefix = "flatshard";
  int64_t memory_limit_bytes = INT64_MAX;
  absl::Duration default_wait = absl::Seconds(60);  // collective waits without an RPC deadline
  // A session whose lease is not open this long after its join completed ends (--lease_timeout).
  absl::Duration lease_timeout = absl::Seconds(10);
  absl::Duration shutdown_grace = absl::Seconds(5);
  // Multi-daemon groups: where this daemon's PeerService listens (host:port; port 0 picks a
  // free one) and what peers call it. Empty: local groups only.
  std::string peer_address;
  std::string node_name;  // empty: the host name
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration peer_timeout = absl::Seconds(3);
  // Access control (README "Access control"). The socket's group (empty: the daemon's).
  std::string socket_group;
  // Uids that may use the Unix socket besides the daemon's own; empty: any that can open it.
  std::vector<uid_t> allowed_uids;
  // Mutual TLS on --tcp_address and --peer_address and for peer channels; none: insecure,
  // loopback addresses only unless allow_insecure_tcp.
  access::TlsFiles tls;
  bool allow_insecure_tcp = false;
  // Prometheus /metrics over HTTP (host:port; port 0 picks a free one). Empty: off.
  std::string metrics_address;
  std::string ucx_error_handling = "auto";  // UcxBackendOptions::error_handling
  bool ucx_hierarchical = true;             // UcxBackendOptions::hierarchical
  bool ucx_same_host_copy = true;  // false: UcxBackendOptions::same_host_copy_min_bytes = 0
  // GPU backend (README "GPU nodes"): the GPUs ranks live on: "" (none: host memory, the
  // default), "all", or device ordinals "0,1,3". Rank r of a group uses the (r mod n)-th.
  std::string gpus;
  // Per GPU: device memory the daemon's pool may reserve (slabs). INT64_MAX: no limit.
  int64_t gpu_memory_limit_bytes = INT64_MAX;
  // How device memory moves: "auto" (NCCL where every rank has its own GPU, else staged
  // through host memory), "nccl" (refuse to start without NCCL), "host" (never NCCL).
  std::string gpu_collectives = "auto";
  // Resources (README "Resources and quotas"). A group without a session for this long is
  // removed (0: never).
  absl::Duration group_idle_timeout = absl::Hours(1);
  // Per uid: groups (0: none), committed host memory (0: none), live segments
  // (-1: half of the daemon's segment budget; 0: none).
  int32_t max_groups_per_uid = 64;
  int64_t memory_quota_bytes_per_uid = 0;
  int64_t max_segments_per_uid = -1;
  // Per uid: committed device memory (buffers allocated for the uid: published device
  // versions, device shards), all GPUs together (0: none).
  int64_t gpu_memory_quota_bytes_per_uid = 0;
  // Descriptors kept for everything but segments (sockets, gRPC, UCX, files): the segment
  // budget is the descriptor limit (raised to its hard limit at start) minus this.
  int64_t fd_reserve = 1024;
  // Testing only: N simulated GPUs whose "device memory" is host shared memory (no CUDA,
  // no NCCL), so the GPU code paths run where there is no GPU. Excludes `gpus`.
  int simulate_gpus = 0;
  // Testing only: each operation of a simulated GPU's stream starts this late.
  absl::Duration simulate_gpu_delay = absl::ZeroDuration();
  // Device-side ordering of summons that are device copies only (RankDevices::OrderOnDevice).
  bool gpu_device_ordering = true;
  // Restarts (README "Restarts"): where the groups' records go (flatshardd picks a default,
  // server/durable/default_state_dir.h). Empty: --ephemeral, nothing is recorded, a restart
  // loses the shards.
  std::string state_dir;
  // How state_dir was chosen, for the start-up log ("--state_dir", "$STATE_DIRECTORY", ...).
  std::string state_dir_why;
  // With a state_dir: SIGTERM leaves the shards, gradient shards and committed copies (and
  // their records) for the next daemon and removes only transient buffers. False, or without
  // a state_dir: SIGTERM frees everything (and removes the records).
  bool keep_shards = true;
  // Published weights: newest versions kept per (owner uid, name) (--weights_keep).
  int32_t weights_keep = 2;
  // Published weights across daemons: peer addresses of daemons this one copies versions
  // from when a local reader asks (--weights_sources; empty: none).
  std::vector<std::string> weights_sources;
  // Testing only: WeightsPeerServiceImpl's testing_copy_pause and testing_ucx_stall_after.
  absl::Duration testing_weights_copy_pause = absl::ZeroDuration();
  int testing_weights_ucx_stall_after = 0;
  // How versions move between daemons: "ucx" (gets, gRPC where UCX cannot) or "grpc".
  std::string weights_transport = "ucx";
  // fsync each record and the state directory (crash-consistent across a machine crash too;
  // a process's death, the case restarts serve, needs only the atomic rename).
  bool state_fsync = true;
  // Testing only: GroupManagerOptions::testing_commit_copy_pause.
  absl::Duration testing_commit_copy_pause = absl::ZeroDuration();
  // Testing only: FIFOs (PATH and PATH.held) each ReduceScatterGrads begin waits on before
  // it allocates (ShardServiceImpl::HoldForTesting). Empty: none.
  std::string testing_hold_begin_reduce_scatter;
};

// The gRPC health service name that answers SERVING as long as the process serves, also while
// draining (liveness); the overall status ("") turns NOT_SERVING on drain (readiness).
inline constexpr char kLivenessHealthService[] = "flatshard.liveness";

class Daemon {
 public:
  // Creates the socket's directory if needed, locks the socket and the state directory for
  // this daemon (InstanceLock: FAILED_PRECONDITION naming the pid of a daemon that holds
  // either), removes a stale socket and leftover segments of a crashed daemon with the same
  // prefix, and starts serving.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const DaemonConfig& config);
  ~Daemon();

  // Blocks until the server has shut down.
  void Wait();
  // Stops accepting work, fails pending collectives with UNAVAILABLE, waits up to the grace
  // period for in-flight RPCs, then removes the socket and all segments.
  void Shutdown();

  const DaemonConfig& config() const { return config_; }
  // The PeerService's address with the port it got; empty without --peer_address.
  const std::string& peer_address() const { return peer_address_; }
  // The metrics endpoint's host:port with the port it got; empty without --metrics_address.
  std::string metrics_address() const;

 private:
  explicit Daemon(DaemonConfig config);
  // Create's steps: the peer port (the coordinator role, UCX and this daemon's identity in
  // `group_options`), and the trainers' and operators' server (Unix socket, --tcp_address,
  // health, metrics).
  // groups_ (and gpus_) from `options`.
  void MakeGroups(GroupManagerOptions options);
  absl::Status StartPeerServer(std::shared_ptr<grpc::ServerCredentials> credentials,
                               GroupManagerOptions* group_options);
  absl::Status StartServer(std::shared_ptr<grpc::ServerCredentials> tcp_credentials);

  DaemonConfig config_;
  // First: released last, after the socket is removed and the state written.
  std::unique_ptr<InstanceLock> socket_lock_;
  std::unique_ptr<InstanceLock> state_dir_lock_;  // null without --state_dir
  std::string peer_address_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<state::StateDir> state_dir_;  // null without --state_dir; outlives groups_
  // UCX copies of published weights (null: gRPC); outlives the weights peer service and client.
  std::unique_ptr<UcxWeightsLink> weights_link_;
  std::unique_ptr<peer::PeerServiceImpl> peer_service_;
  // Checkpoints of multi-daemon groups: the other daemons' requests, on the peer port.
  std::unique_ptr<CheckpointPeerServiceImpl> checkpoint_peer_;
  // Published weights between daemons: other daemons' reads and copies, on the peer port.
  std::unique_ptr<WeightsPeerServiceImpl> weights_peer_;
  std::unique_ptr<grpc::Server> peer_server_;  // PeerService only, on its own TCP port
  std::unique_ptr<GroupManager> groups_;
  // Before the services and server_: handlers ask access_, which asks acceptor_.
  std::unique_ptr<access::UnixSocketAcceptor> acceptor_;
  std::unique_ptr<access::AccessControl> access_;
  // This daemon's copies from other daemons (multi-daemon publishes, --weights_sources);
  // before publisher_, which uses them.
  std::unique_ptr<WeightsPeerClient> weights_peer_client_;
  std::unique_ptr<DistributedPublish> distributed_publish_;
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;  // --gpus (also in groups_)
  std::unique_ptr<Publisher> publisher_;                   // after groups_: it reads through them
  std::unique_ptr<WeightsPuller> weights_puller_;          // null without --weights_sources
  // The services' slow call bodies (request_workers.h): outlives server_->Shutdown, which waits
  // for the calls they finish; reset by Shutdown (running what is queued) before the groups
  // and the store stop.
  std::unique_ptr<RequestWorkers> request_workers_;
  std::unique_ptr<ShardServiceImpl> shard_service_;
  std::unique_ptr<TransitionLaneService> transition_lane_;  // runs its requests through it
  std::unique_ptr<WeightsServiceImpl> weights_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;  // stopped first in Shutdown
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Create finished: a daemon destroyed before that never served and forgets nothing.
  bool started_ = false;
};

}  // namespace flatshard::server
