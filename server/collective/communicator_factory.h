#pragma once
// CommunicatorFactory: the one place that decides how a group's collectives move bytes, and
// connects them. The daemon's GroupManager gives it a group's shape (its local ranks, their
// GPUs, the peers' backend addresses, whether the rendezvous agreed on NCCL) and gets back a
// Communicator with the name of the backend that runs it:
//
//   every rank local, host memory             inproc (created through the BackendRegistry)
//   every rank local, one GPU per rank, NCCL  nccl
//   every rank local, GPUs otherwise          inproc, staged (device <-> pinned host copies)
//   ranks on several daemons                  ucx, staged when the ranks live on GPUs
//   several daemons, the rendezvous said nccl nccl
//
// A GPU daemon's buffers are device memory; whatever backend runs them, the communicator is
// wrapped in a StagingCommunicator (backend.h MemoryKind of the backend: kHost for inproc and
// UCX, kCuda for NCCL), so buffers the backend cannot reach are staged and the others pass
// through. It also hands out the NCCL unique id a multi-daemon group's rank 0 brings to the
// rendezvous (the only `#if FS_HAVE_NCCL` of the group logic lives in its .cc).
//
// Choose() is cheap and does no I/O (call it under a lock to decide); Connect() may block for
// as long as the backend needs (UCX round trips, NCCL device queries and communicator
// creation): never call it under a lock another thread may need meanwhile.
//
// ConnectAsync() runs Connect() on the factory's own thread (one connect after another), so
// that no gRPC thread waits on a UCX round trip or a GPU.
//
// Thread-safe: immutable after Create but for ConnectAsync's queue; the backends are
// thread-safe (backend.h). The destructor runs the connects still queued (their callbacks
// too) and joins the thread.

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/collective/backend.h"
#include "server/collective/backend_registry.h"
#include "server/collective/staging/staging_communicator.h"

namespace flatshard::collective {

struct CommunicatorFactoryOptions {
  // Where the inproc backend comes from ("inproc", with `inproc_params`). Null: a registry
  // with the built-in backends (RegisterBuiltinBackends).
  const BackendRegistry* registry = nullptr;
  BackendParams inproc_params;
  // Moves bytes between daemons (UCX). Null: multi-daemon groups are refused.
  std::unique_ptr<CollectiveBackend> remote;
  // NCCL, for groups whose local ranks each have a GPU of their own (and multi-daemon groups
  // whose rendezvous agreed on NCCL). Null (no NCCL build, --gpu_collectives=host, no GPU):
  // device memory is staged over the host path. Must be viable when given.
  std::unique_ptr<CollectiveBackend> nccl;
  // Host <-> device copies for staging; required for requests with `local_devices`.
  std::shared_ptr<DeviceCopier> copier;
};

// What one group needs of its communicator.
struct CommunicatorRequest {
  // group_id, world_size, epoch, local_ranks; `rank_addresses` non-empty for a multi-daemon
  // group; `local_devices` (one per local rank) on a GPU daemon, empty for host memory;
  // `nccl_unique_id` from the rendezvous (used only when NCCL is chosen).
  GroupSpec spec;
  // Multi-daemon groups: every daemon of the group can run NCCL and the rendezvous agreed on
  // it (PeerTable::device_transport "nccl"). Ignored for local groups, which decide alone.
  bool nccl_agreed = false;
};

// The factory's decision for a request.
struct BackendChoice {
  std::string backend_name;                     // the backend's Name(): "inproc", "ucx", "nccl"
  MemoryKind backend_kind = MemoryKind::kHost;  // the memory the backend moves itself
  bool staged = false;                          // wrapped in a StagingCommunicator (a GPU daemon)
};

struct ConnectedCommunicator {
  std::unique_ptr<Communicator> comm;
  BackendChoice choice;
  GroupSpec spec;  // as connected: what CollectiveEngine::AddGroup gets
  const std::string& backend_name() const { return choice.backend_name; }
};

class CommunicatorFactory {
 public:
  // INVALID_ARGUMENT for bad `inproc_params`; FAILED_PRECONDITION for an NCCL backend that
  // cannot run here (not viable: no usable GPU) or an unknown "inproc" in `registry`.
  static absl::StatusOr<std::unique_ptr<CommunicatorFactory>> Create(
      CommunicatorFactoryOptions options);

  ~CommunicatorFactory();
  CommunicatorFactory(const CommunicatorFactory&) = delete;
  CommunicatorFactory& operator=(const CommunicatorFactory&) = delete;

  bool has_remote() const { return remote_ != nullptr; }
  bool has_nccl() const { return nccl_ != nullptr; }
  // The remote backend's address (published at the rendezvous); empty without one.
  std::string RemoteAddress() const;
  // The remote backend's GroupSettings (published at the rendezvous); empty without one.
  std::string RemoteSettings() const;

  // Which backend `request` gets (no I/O). INVALID_ARGUMENT for a malformed request
  // (local_devices not one per local rank); FAILED_PRECONDITION for a multi-daemon group
  // without a remote backend, or device memory without a DeviceCopier.
  absl::StatusOr<BackendChoice> Choose(const CommunicatorRequest& request) const;

  // Chooses and connects. May block (see the file comment). Errors: Choose's, then the
  // backend's Connect's.
  absl::StatusOr<ConnectedCommunicator> Connect(CommunicatorRequest request) const;
  // Connect() on the factory's thread; `done` runs there, exactly once, in the order of the
  // calls.
  using ConnectCallback = absl::AnyInvocable<void(absl::StatusOr<ConnectedCommunicator>)>;
  void ConnectAsync(CommunicatorRequest request, ConnectCallback done);
  // Whether Connect() for `choice` may block (a remote backend or NCCL): such connects belong
  // on ConnectAsync. An inproc connect (host or staged) only builds local state.
  static bool MayBlock(const BackendChoice& choice) { return choice.backend_name != "inproc"; }

  // A fresh NCCL unique id for a multi-daemon group's rendezvous (rank 0's daemon brings one
  // per round). FAILED_PRECONDITION without an NCCL backend or in a build without NCCL;
  // NCCL's errors otherwise (UNAVAILABLE: no bootstrap interface).
  absl::StatusOr<std::string> NcclUniqueId() const;

 private:
  CommunicatorFactory() = default;
  void ConnectLoop();

  std::unique_ptr<CollectiveBackend> inproc_;
  std::unique_ptr<CollectiveBackend> remote_;
  std::unique_ptr<CollectiveBackend> nccl_;
  std::shared_ptr<DeviceCopier> copier_;

  struct Queued {
    CommunicatorRequest request;
    ConnectCallback done;
  };
  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started by the first ConnectAsync
};

}  // namespace flatshard::collective
