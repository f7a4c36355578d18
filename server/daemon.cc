#include "server/daemon.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_system.h"
#include "common/gpu/cuda_runtime_library.h"
#include "common/gpu/cuda_util.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"
#include "server/access/access_control.h"
#include "server/access/tls_config.h"
#include "server/access/unix_socket_acceptor.h"
#include "server/checkpoint/checkpoint_peer_service.h"
#include "server/collective/backend_registry.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/durable/state_dir.h"
#include "server/gpu/device_context.h"
#include "server/group_manager.h"
#include "server/instance_lock.h"
#include "server/metrics/daemon_gauges.h"
#include "server/metrics/daemon_metrics.h"
#include "server/metrics/http_server.h"
#include "server/metrics/process_metrics.h"
#include "server/peer/peer_service_impl.h"
#include "server/publish/distributed_publish.h"
#include "server/publish/ucx_weights_link.h"
#include "server/publish/weights_peer_client.h"
#include "server/publish/weights_peer_service.h"
#include "server/publish/weights_puller.h"
#include "server/service/admin_service_impl.h"
#include "server/service/answer_interceptor.h"
#include "server/service/shard_service_impl.h"
#include "server/service/transition_lane_service.h"
#include "server/service/weights_service_impl.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

// Creates the socket's directory if needed and locks the socket for this daemon (before
// anything touches it: a live daemon's socket is never removed), then removes a socket left by
// a daemon that did not shut down cleanly; refuses other files.
absl::StatusOr<std::unique_ptr<InstanceLock>> PrepareSocketPath(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path() && !std::filesystem::exists(p.parent_path(), ec)) {
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot create the socket directory ", p.parent_path().string(), ": ", ec.message()));
    }
  }
  FS_ASSIGN_OR_RETURN(
      std::unique_ptr<InstanceLock> lock,
      InstanceLock::Acquire(absl::StrCat(path, ".lock"), InstanceLock::Kind::kLockFile,
                            absl::StrCat("--socket unix:", path)));
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    if (::unlink(path.c_str()) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot remove the stale socket ", path, ": ", std::strerror(errno)));
    }
  }
  return lock;
}

// The publisher of weights, with the versions a previous daemon left in --state_dir/weights.
// Out of line: inlined into Create it trips GCC 12's -Wmaybe-uninitialized on an absl::Cleanup.
[[gnu::noinline]] absl::StatusOr<std::unique_ptr<Publisher>> MakePublisher(
    const DaemonConfig& config, ShardStore* store, GroupManager* groups,
    DistributedPublish* distributed, const std::vector<std::shared_ptr<gpu::DeviceContext>>& gpus) {
  PublisherOptions o;
  o.store = store;
  o.groups = groups;
  o.gpus = gpus;
  o.distributed = distributed;
  o.keep = config.weights_keep;
  o.daemon_uid = static_cast<int64_t>(::getuid());
  if (!config.state_dir.empty()) o.files_dir = absl::StrCat(config.state_dir, "/weights");
  FS_RETURN_IF_ERROR(Publisher::ValidateOptions(o));
  auto publisher = std::make_unique<Publisher>(std::move(o));
  publisher->Adopt();
  return publisher;
}

// Locks --state_dir (made a 0700 directory first) before StateDir::Open touches it: a live
// daemon's records, temp files and shards are never taken by a second one. Null without one.
absl::StatusOr<std::unique_ptr<InstanceLock>> LockStateDir(const DaemonConfig& config) {
  if (config.state_dir.empty()) {
    FS_LOG(WARNING) << "ephemeral ("
                    << (config.state_dir_why.empty() ? "no state dir" : config.state_dir_why)
                    << "): no records are kept; a restart loses every group's shards";
    return nullptr;
  }
  FS_LOG(INFO) << "state dir " << config.state_dir << " ("
               << (config.state_dir_why.empty() ? "--state_dir" : config.state_dir_why)
               << "): groups' records are kept there across restarts";
  if (absl::Status s = FileSystem::Posix()->CreateDirs(config.state_dir, 0700); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--state_dir ", config.state_dir,
        ": cannot make it a 0700 directory (records hold group tokens): ", s.message()));
  }
  return InstanceLock::Acquire(config.state_dir, InstanceLock::Kind::kDirectory,
                               absl::StrCat("--state_dir ", config.state_dir));
}

}  // namespace

Daemon::Daemon(DaemonConfig config) : config_(std::move(config)) {}

namespace {

// Raises the descriptor soft limit to the hard limit (every host segment holds a descriptor)
// and sets the store's segment budget below it, so that a tenant with many units is refused
// cleanly (RESOURCE_EXHAUSTED) before the daemon runs out of descriptors for everyone.
absl::Status SetUpDescriptorBudget(const DaemonConfig& config, ShardStoreOptions* store) {
  if (config.fd_reserve < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fd_reserve must be >= 0, got ", config.fd_reserve));
  }
  if (config.memory_quota_bytes_per_uid < 0) {
    return absl::InvalidArgumentError("--memory_quota_mib_per_uid must be >= 0 (0: none)");
  }
  if (config.max_segments_per_uid < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_segments_per_uid must be -1 (auto), 0 (none) or more, got ",
                     config.max_segments_per_uid));
  }
  if (config.max_groups_per_uid < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_groups_per_uid must be >= 0 (0: none), got ", config.max_groups_per_uid));
  }
  struct rlimit limit = {};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  const rlim_t before = limit.rlim_cur;
  if (limit.rlim_cur != limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      FS_LOG(WARNING) << "cannot raise the descriptor limit from " << before << " to "
                      << limit.rlim_max << ": " << std::strerror(errno);
      limit.rlim_cur = before;
    }
  }
  // RLIM_INFINITY cannot happen for RLIMIT_NOFILE on Linux (nr_open caps it); be safe anyway.
  const int64_t soft =
      limit.rlim_cur == RLIM_INFINITY ? int64_t{1} << 30 : static_cast<int64_t>(limit.rlim_cur);
  // Never less than half of the descriptors for segments, whatever the reserve.
  const int64_t budget = std::max(soft - config.fd_reserve, soft / 2);
  store->max_segments = std::max<int64_t>(budget, 1);
  store->memory_quota_bytes_per_uid = config.memory_quota_bytes_per_uid;
  store->device_quota_bytes_per_uid = config.gpu_memory_quota_bytes_per_uid;
  store->max_segments_per_uid = config.max_segments_per_uid < 0 ? std::max<int64_t>(budget / 2, 1)
                                                                : config.max_segments_per_uid;
  FS_LOG(INFO) << "descriptors: limit " << soft
               << (static_cast<rlim_t>(soft) != before ? absl::StrCat(" (raised from ", before, ")")
                                                       : std::string())
               << ", segment budget " << store->max_segments << " (reserve "
               << soft - store->max_segments << "), per uid "
               << (store->max_segments_per_uid == 0 ? std::string("unlimited")
                                                    : absl::StrCat(store->max_segments_per_uid))
               << " segments and "
               << (store->memory_quota_bytes_per_uid == 0
                       ? std::string("unlimited memory")
                       : absl::StrCat(store->memory_quota_bytes_per_uid, " bytes"));
  return absl::OkStatus();
}

}  // namespace

namespace {

// --gpus: a DeviceContext (pool, stream, events) per GPU, their pools in the store, and NCCL
// when it can run. Without --gpus nothing here touches CUDA.
absl::Status SetUpGpus(const DaemonConfig& config, ShardStoreOptions* store_options,
                       GroupManagerOptions* group_options) {
  if (config.simulate_gpus < 0 || config.simulate_gpus > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--simulate_gpus must be in [0, 64], got ", config.simulate_gpus));
  }
  if (config.simulate_gpus > 0) {
    if (!config.gpus.empty() && config.gpus != "none") {
      return absl::InvalidArgumentError("--simulate_gpus and --gpus exclude each other");
    }
    store_options->device_pools.resize(config.simulate_gpus);
    store_options->pin_host_memory = false;
    for (int i = 0; i < config.simulate_gpus; ++i) {
      gpu::DevicePoolOptions pool;
      pool.limit_bytes = config.gpu_memory_limit_bytes;
      FS_ASSIGN_OR_RETURN(std::unique_ptr<gpu::DeviceContext> context,
                          gpu::DeviceContext::CreateSimulated(i, pool, config.segment_prefix,
                                                              config.simulate_gpu_delay));
      std::shared_ptr<gpu::DeviceContext> shared = std::move(context);
      store_options->device_pools[i] = shared->pool();
      group_options->gpus.push_back(std::move(shared));
    }
    group_options->copier = collective::MakeSimulatedDeviceCopier();
    FS_LOG(WARNING) << "--simulate_gpus=" << config.simulate_gpus
                    << ": GPU code paths over host shared memory, for testing only";
    return absl::OkStatus();
  }
  if (config.gpus.empty() || config.gpus == "none") return absl::OkStatus();
  if (config.gpu_collectives != "auto" && config.gpu_collectives != "nccl" &&
      config.gpu_collectives != "host") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_collectives must be auto, nccl or host, got '", config.gpu_collectives, "'"));
  }
  if (config.gpu_memory_limit_bytes < 0) {
    return absl::InvalidArgumentError("--gpu_memory_limit_mib must be >= 0");
  }
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--gpus=", config.gpus, ": ", gpus.status().message()));
  }
  FS_LOG(INFO) << "CUDA runtime: " << gpu::CudaRuntimePath();  // loaded at run time
  std::vector<int> ordinals;
  if (config.gpus == "all") {
    for (const gpu::GpuDevice& g : *gpus) ordinals.push_back(g.ordinal);
  } else {
    for (absl::string_view part : absl::StrSplit(config.gpus, ',')) {
      int ordinal = -1;
      if (!absl::SimpleAtoi(part, &ordinal) || ordinal < 0 ||
          ordinal >= static_cast<int>(gpus->size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("--gpus: '", part, "' is not a GPU of this machine (it has ", gpus->size(),
                         "; ordinals 0..", gpus->size() - 1, ", or 'all')"));
      }
      if (std::find(ordinals.begin(), ordinals.end(), ordinal) != ordinals.end()) {
        return absl::InvalidArgumentError(absl::StrCat("--gpus names GPU ", ordinal, " twice"));
      }
      ordinals.push_back(ordinal);
    }
  }
  store_options->device_pools.resize(gpus->size());
  for (int ordinal : ordinals) {
    const gpu::GpuDevice& device = (*gpus)[ordinal];
    gpu::DevicePoolOptions pool;
    pool.device = ordinal;
    pool.device_uuid = device.uuid;
    pool.limit_bytes = config.gpu_memory_limit_bytes;
    absl::StatusOr<std::unique_ptr<gpu::DeviceContext>> context =
        gpu::DeviceContext::Create(device, pool);
    if (!context.ok()) {
      return absl::Status(context.status().code(), absl::StrCat("GPU ", ordinal, " (", device.uuid,
                                                                "): ", context.status().message()));
    }
    std::shared_ptr<gpu::DeviceContext> shared = *std::move(context);
    store_options->device_pools[ordinal] = shared->pool();
    group_options->gpus.push_back(std::move(shared));
    FS_LOG(INFO) << "GPU " << ordinal << ": " << device.name << " " << device.uuid << " "
                 << (device.total_bytes >> 20) << " MiB, pool limit "
                 << (config.gpu_memory_limit_bytes == INT64_MAX
                         ? std::string("none")
                         : absl::StrCat(config.gpu_memory_limit_bytes >> 20, " MiB"));
  }
  group_options->copier = collective::MakeCudaDeviceCopier();
  if (config.gpu_collectives != "host") {
    collective::BackendRegistry registry;
    FS_RETURN_IF_ERROR(collective::RegisterBuiltinBackends(registry));
    absl::StatusOr<std::unique_ptr<collective::CollectiveBackend>> nccl =
        registry.Create("nccl", {});
    if (nccl.ok() && (*nccl)->IsViable()) {
      group_options->nccl_backend = *std::move(nccl);
    } else if (config.gpu_collectives == "nccl") {
      return absl::FailedPreconditionError(
          absl::StrCat("--gpu_collectives=nccl: NCCL cannot run here: ",
                       nccl.ok() ? "the backend is not viable" : nccl.status().message()));
    } else {
      FS_LOG(WARNING) << "NCCL unavailable ("
                      << (nccl.ok() ? "not viable" : nccl.status().message())
                      << "): device memory moves staged through host memory";
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Out of line (noinline): more inlined into Create trips GCC 12's -Wmaybe-uninitialized on its
// absl::Cleanup.
[[gnu::noinline]] void Daemon::MakeGroups(GroupManagerOptions options) {
  gpus_ = options.gpus;  // the publisher's too
  groups_ = std::make_unique<GroupManager>(store_.get(), std::move(options));
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const DaemonConfig& config) {
  if (config.socket_path.empty()) return absl::InvalidArgumentError("--socket must not be empty");
  // Access control (README "Access control"): TCP ports use mutual TLS when configured and
  // stay on loopback otherwise (unless --allow_insecure_tcp); checked before anything starts.
  std::shared_ptr<grpc::ServerCredentials> tcp_credentials;
  std::shared_ptr<grpc::ServerCredentials> peer_credentials;
  if (!config.tcp_address.empty()) {
    FS_ASSIGN_OR_RETURN(tcp_credentials,
                        access::ServerCredentialsFor(config.tls, config.allow_insecure_tcp,
                                                     "--tcp_address", config.tcp_address));
  }
  if (!config.peer_address.empty()) {
    FS_ASSIGN_OR_RETURN(peer_credentials,
                        access::ServerCredentialsFor(config.tls, config.allow_insecure_tcp,
                                                     "--peer_address", config.peer_address));
  }
  ShardStoreOptions store_options;
  store_options.segment_prefix = config.segment_prefix;
  store_options.memory_limit_bytes = config.memory_limit_bytes;
  FS_RETURN_IF_ERROR(SetUpDescriptorBudget(config, &store_options));
  FS_RETURN_IF_ERROR(ShardStore::ValidateOptions(store_options));
  // Both locks before the socket is touched or listens: a refused daemon changes nothing.
  FS_ASSIGN_OR_RETURN(std::unique_ptr<InstanceLock> socket_lock,
                      PrepareSocketPath(config.socket_path));
  FS_ASSIGN_OR_RETURN(std::unique_ptr<InstanceLock> state_dir_lock, LockStateDir(config));
  // The Unix socket is accepted by hand to learn each client's uid (SO_PEERCRED); it listens
  // now, before anything can fail half-built, and serves once the gRPC server runs. A start
  // that fails from here on removes it (under the lock: never another daemon's).
  FS_ASSIGN_OR_RETURN(std::unique_ptr<access::UnixSocketAcceptor> acceptor,
                      access::UnixSocketAcceptor::Listen(config.socket_path, config.socket_group));
  // A plain guard, not absl::Cleanup: GCC 12 reports absl::Cleanup's stored callback here as
  // maybe-uninitialized (-Werror), depending on DaemonConfig's layout.
  struct SocketGuard {
    const char* path;
    bool armed = true;
    ~SocketGuard() {
      if (armed) ::unlink(path);
    }
  } remove_socket{config.socket_path.c_str()};
  // Restarts: the records of the previous daemon's groups; their segments stay, every other
  // segment it left goes (refused records' segments are left alone too).
  std::unique_ptr<state::StateDir> state_dir;
  state::StateDir::Loaded loaded;
  if (!config.state_dir.empty()) {
    FS_ASSIGN_OR_RETURN(state_dir, state::StateDir::Open(config.state_dir, config.state_fsync));
    loaded = state_dir->LoadAll();
    FS_RETURN_IF_ERROR(state::UnlinkUnreferencedSegments(
        config.segment_prefix, state_dir->SegmentsNamedBy(loaded, config.segment_prefix)));
  } else {
    FS_RETURN_IF_ERROR(UnlinkSegmentsWithPrefix(config.segment_prefix));
  }

  GroupManagerOptions group_options;
  group_options.group_idle_timeout = config.group_idle_timeout;
  group_options.max_groups_per_uid = config.max_groups_per_uid;
  FS_RETURN_IF_ERROR(SetUpGpus(config, &store_options, &group_options));
  group_options.gpu_device_ordering = config.gpu_device_ordering;

  std::unique_ptr<Daemon> d(new Daemon(config));
  d->store_ = std::make_unique<ShardStore>(store_options);
  d->state_dir_ = std::move(state_dir);
  group_options.state_dir = d->state_dir_.get();
  group_options.testing_commit_copy_pause = config.testing_commit_copy_pause;

  FS_ASSIGN_OR_RETURN(
      d->weights_link_,
      OpenWeightsLink(config.weights_transport, config.ucx_error_handling,
                      !config.peer_address.empty() || !config.weights_sources.empty()));
  if (!config.peer_address.empty()) {
    FS_RETURN_IF_ERROR(d->StartPeerServer(peer_credentials, &group_options));
  }
  if (config.lease_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--lease_timeout must be positive, got ",
                                                   absl::FormatDuration(config.lease_timeout)));
  }
  group_options.lease_timeout = config.lease_timeout;
  d->MakeGroups(std::move(group_options));
  if (d->state_dir_ != nullptr) d->groups_->AdoptGroups(loaded.groups);
  if (d->checkpoint_peer_) d->checkpoint_peer_->SetGroups(d->groups_.get());
  d->acceptor_ = std::move(acceptor);
  d->access_ = std::make_unique<access::AccessControl>(d->acceptor_.get(), config.allowed_uids);
  d->request_workers_ = std::make_unique<RequestWorkers>();
  d->shard_service_ = std::make_unique<ShardServiceImpl>(
      d->groups_.get(), d->request_workers_.get(), config.default_wait, d->access_.get(),
      config.testing_hold_begin_reduce_scatter);
  d->transition_lane_ = std::make_unique<TransitionLaneService>(d->shard_service_.get());
  // Published weights: copies between daemons over the peer channels (README "Published
  // weights across daemons").
  FS_RETURN_IF_ERROR(WeightsPuller::ValidateSources(config.weights_sources));
  {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                        access::PeerChannelCredentials(config.tls));
    d->weights_peer_client_ =
        std::make_unique<WeightsPeerClient>(creds, d->store_.get(), d->weights_link_.get());
    d->distributed_publish_ = std::make_unique<DistributedPublish>(d->weights_peer_client_.get());
  }
  FS_ASSIGN_OR_RETURN(d->publisher_, MakePublisher(config, d->store_.get(), d->groups_.get(),
                                                   d->distributed_publish_.get(), d->gpus_));
  if (d->weights_peer_) {
    d->weights_peer_->SetTargets(d->groups_.get(), d->publisher_.get(),
                                 &d->distributed_publish_->rounds());
  }
  if (!config.weights_sources.empty()) {
    d->weights_puller_ = std::make_unique<WeightsPuller>(
        d->publisher_.get(), d->weights_peer_client_.get(), config.weights_sources);
  }
  d->weights_service_ = std::make_unique<WeightsServiceImpl>(
      d->publisher_.get(), d->request_workers_.get(), d->access_.get(), config.default_wait,
      d->weights_puller_.get());
  AdminServiceOptions admin_options;
  admin_options.store = d->store_.get();
  admin_options.peer_address = d->peer_address_;
  admin_options.node = config.node_name;
  admin_options.state_dir = config.state_dir;
  admin_options.access = d->access_.get();
  admin_options.workers = d->request_workers_.get();
  // Draining: the overall health ("") answers NOT_SERVING, so readiness probes take the node
  // out; kLivenessHealthService stays SERVING, so liveness probes do not restart it meanwhile.
  // Undrain sets it SERVING again (after Shutdown the health service ignores it).
  admin_options.on_drain = [daemon = d.get()](bool draining) {
    if (daemon->server_ == nullptr) return;
    if (auto* health = daemon->server_->GetHealthCheckService()) {
      health->SetServingStatus("", !draining);
    }
  };
  d->admin_service_ =
      std::make_unique<AdminServiceImpl>(d->groups_.get(), std::move(admin_options));

  FS_RETURN_IF_ERROR(d->StartServer(tcp_credentials));
  // The socket is 0660 (group: --socket_group) since UnixSocketAcceptor::Listen.
  d->acceptor_->Start(d->server_.get());
  FS_LOG(INFO) << "flatshardd listening on unix:" << config.socket_path
               << (config.tcp_address.empty() ? "" : " and " + config.tcp_address)
               << ", segments /dev/shm/" << config.segment_prefix << ".*"
               << (d->peer_address_.empty() ? "" : ", peers on " + d->peer_address_);
  remove_socket.armed = false;
  d->socket_lock_ = std::move(socket_lock);
  d->state_dir_lock_ = std::move(state_dir_lock);
  d->started_ = true;
  return d;
}

absl::Status Daemon::StartPeerServer(std::shared_ptr<grpc::ServerCredentials> credentials,
                                     GroupManagerOptions* group_options) {
  // The coordinator role: other daemons (and this one) meet here for groups whose ranks
  // name this daemon's peer address.
  peer::PeerOptions peer_options;
  peer_options.heartbeat_interval = config_.heartbeat_interval;
  peer_options.peer_timeout = config_.peer_timeout;
  FS_ASSIGN_OR_RETURN(peer_options.credentials, access::PeerChannelCredentials(config_.tls));
  peer_service_ = std::make_unique<peer::PeerServiceImpl>(peer_options);
  grpc::ServerBuilder peer_builder;
  int peer_port = 0;
  peer_builder.AddListeningPort(config_.peer_address, credentials, &peer_port);
  peer_builder.RegisterService(peer_service_.get());
  checkpoint_peer_ = std::make_unique<CheckpointPeerServiceImpl>();
  peer_builder.RegisterService(checkpoint_peer_.get());
  weights_peer_ = std::make_unique<WeightsPeerServiceImpl>(config_.testing_weights_copy_pause,
                                                           weights_link_.get(),
                                                           config_.testing_weights_ucx_stall_after);
  peer_builder.RegisterService(weights_peer_.get());
  peer_server_ = peer_builder.BuildAndStart();
  if (peer_server_ == nullptr || peer_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --peer_address ", config_.peer_address));
  }
  const size_t colon = config_.peer_address.rfind(':');
  peer_address_ = absl::StrCat(config_.peer_address.substr(0, colon), ":", peer_port);

  collective::BackendRegistry registry;
  FS_RETURN_IF_ERROR(collective::RegisterBuiltinBackends(registry));
  absl::StatusOr<std::unique_ptr<collective::CollectiveBackend>> ucx =
      registry.Create("ucx", {{"error_handling", config_.ucx_error_handling},
                              {"hierarchical", config_.ucx_hierarchical ? "on" : "off"},
                              {"same_host_copy", config_.ucx_same_host_copy ? "on" : "off"}});
  if (!ucx.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--peer_address needs the UCX backend, which this build lacks: ", ucx.status().message()));
  }
  group_options->remote_backend = *std::move(ucx);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  group_options->self.node = config_.node_name.empty() ? std::string(host) : config_.node_name;
  group_options->self.daemon_id =
      absl::StrCat(group_options->self.node, "/", ::getpid(), "/", absl::ToUnixMicros(absl::Now()));
  group_options->self.peer_address = peer_address_;
  group_options->peer = peer_options;
  return absl::OkStatus();
}

absl::Status Daemon::StartServer(std::shared_ptr<grpc::ServerCredentials> tcp_credentials) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int tcp_port = 0;
  if (!config_.tcp_address.empty()) {
    builder.AddListeningPort(config_.tcp_address, tcp_credentials, &tcp_port);
  }
  builder.RegisterService(shard_service_.get());
  builder.RegisterService(transition_lane_.get());
  builder.RegisterService(admin_service_.get());
  builder.RegisterService(weights_service_.get());
  // Plans of large models exceed gRPC's 4 MiB default; bytes never travel here anyway. A
  // request beyond kMaxRequestBytes (README "Limits") is refused before it is parsed.
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(-1);
  // Marks the daemon's answers (clients retry only what never reached it), turns unparsable
  // requests into INVALID_ARGUMENT and bounds error texts.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(NewAnswerInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || (!config_.tcp_address.empty() && tcp_port == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on unix:", config_.socket_path,
        config_.tcp_address.empty() ? "" : absl::StrCat(" and ", config_.tcp_address)));
  }
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(kLivenessHealthService, true);
  }
  if (!config_.metrics_address.empty()) {
    metrics::GetDaemonMetrics();  // every family shows (at 0) from the first scrape
    Daemon* daemon = this;
    FS_ASSIGN_OR_RETURN(
        metrics_server_, metrics::MetricsServer::Start(config_.metrics_address, [daemon] {
          UpdateDaemonGauges(*daemon->store_, *daemon->groups_);
          std::string text = metrics::DefaultRegistry().Render();
          // Without /proc the scrape just lacks the process_* metrics.
          absl::StatusOr<metrics::ProcessStats> process = metrics::ReadProcessStats();
          if (process.ok()) text += metrics::RenderProcessMetrics(*process);
          return text;
        }));
    FS_LOG(INFO) << "metrics on http://" << metrics_server_->address() << "/metrics";
  }
  return absl::OkStatus();
}

Daemon::~Daemon() { Shutdown(); }

std::string Daemon::metrics_address() const {
  return metrics_server_ ? metrics_server_->address() : std::string();
}

void Daemon::Wait() {
  if (server_) server_->Wait();
}

void Daemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  FS_LOG(INFO) << "flatshardd shutting down (grace " << config_.shutdown_grace << ")";
  // A daemon whose Create failed part way has only some of its parts: it never served, so it
  // keeps whatever state it adopted for the next start.
  const bool served = started_;
  if (server_ != nullptr) {
    if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
  }
  metrics_server_.reset();           // its render reads the store and the groups
  if (groups_) groups_->Shutdown();  // pending collectives finish with UNAVAILABLE
  // Copies between daemons end first (cancelled), then the readers waiting on them, then
  // pending publishes.
  if (distributed_publish_) distributed_publish_->Shutdown();
  if (weights_puller_) weights_puller_->Shutdown();
  if (publisher_) publisher_->Shutdown();  // pending publishes too
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoNanoseconds(config_.shutdown_grace);
  if (peer_service_) peer_service_->Shutdown();  // pending rendezvous fail, streams end
  if (weights_peer_) weights_peer_->Stop();      // other daemons' WatchVersions streams end
  if (peer_server_) peer_server_->Shutdown(deadline);
  if (checkpoint_peer_) checkpoint_peer_->Stop();      // its calls use groups_
  if (acceptor_) acceptor_->Stop();                    // no new connections while the server drains
  if (transition_lane_) transition_lane_->Shutdown();  // clients keep lanes open: end them
  if (server_ != nullptr) server_->Shutdown(deadline);
  // The calls are finished; the bodies that finish none (a lease's EndSession, a weights
  // lease's release) run now, before the groups and the store go.
  request_workers_.reset();
  if (weights_link_) weights_link_->Shutdown();  // after the copies that use it ended
  // --keep_shards (with --state_dir): shards, gradient shards and committed copies stay with
  // their records for the next daemon; otherwise the records go first, then the segments.
  const bool keep = (config_.keep_shards || !served) && state_dir_ != nullptr;
  if (groups_ && keep) groups_->KeepDeviceShards();  // GPU daemons: device memory dies with us
  if (groups_ && !keep) groups_->ForgetState();
  if (store_) store_->Shutdown(keep);
  ::unlink(config_.socket_path.c_str());
  FS_LOG(INFO) << (keep ? "flatshardd stopped: socket and transient segments removed; shards "
                          "and their records in " +
                              config_.state_dir + " kept for the next daemon (--keep_shards)"
                        : std::string("flatshardd stopped: socket and segments removed"));
}

}  // namespace flatshard::server
