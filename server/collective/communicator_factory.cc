#include "server/collective/communicator_factory.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status_macros.h"
#if FS_HAVE_NCCL
#include "server/collective/nccl/nccl_backend.h"
#endif

namespace flatshard::collective {

absl::StatusOr<std::unique_ptr<CommunicatorFactory>> CommunicatorFactory::Create(
    CommunicatorFactoryOptions options) {
  std::unique_ptr<CommunicatorFactory> f(new CommunicatorFactory());
  BackendRegistry builtin;
  const BackendRegistry* registry = options.registry;
  if (registry == nullptr) {
    FS_RETURN_IF_ERROR(RegisterBuiltinBackends(builtin));
    registry = &builtin;
  }
  if (!registry->Has("inproc")) {
    return absl::FailedPreconditionError(
        "communicator factory: the backend registry has no \"inproc\" backend");
  }
  FS_ASSIGN_OR_RETURN(f->inproc_, registry->Create("inproc", options.inproc_params));
  if (options.nccl != nullptr && !options.nccl->IsViable()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "communicator factory: the ", options.nccl->Name(),
        " backend cannot run here (no usable GPU or NCCL library); start flatshardd with "
        "--gpu_collectives=host to stage device memory over the host path"));
  }
  f->remote_ = std::move(options.remote);
  f->nccl_ = std::move(options.nccl);
  f->copier_ = std::move(options.copier);
  return f;
}

CommunicatorFactory::~CommunicatorFactory() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void CommunicatorFactory::ConnectAsync(CommunicatorRequest request, ConnectCallback done) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(Queued{std::move(request), std::move(done)});
  if (!thread_.joinable()) thread_ = std::thread([this] { ConnectLoop(); });
}

void CommunicatorFactory::ConnectLoop() {
  for (;;) {
    Queued next;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, nothing left
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    // Outside mu_: the connect may take long, and `done` may call ConnectAsync.
    next.done(Connect(std::move(next.request)));
  }
}

std::string CommunicatorFactory::RemoteAddress() const {
  return remote_ == nullptr ? std::string() : remote_->LocalAddress();
}

std::string CommunicatorFactory::RemoteSettings() const {
  return remote_ == nullptr ? std::string() : remote_->GroupSettings();
}

absl::StatusOr<BackendChoice> CommunicatorFactory::Choose(
    const CommunicatorRequest& request) const {
  const GroupSpec& spec = request.spec;
  const bool on_gpus = !spec.local_devices.empty();
  if (on_gpus && spec.local_devices.size() != spec.local_ranks.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group ", spec.group_id, ": ", spec.local_devices.size(), " local devices for ",
        spec.local_ranks.size(), " local ranks (one device per local rank)"));
  }
  if (on_gpus && copier_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", spec.group_id,
                     ": its ranks live on GPUs but this daemon has no DeviceCopier "
                     "to stage their memory"));
  }
  const bool multi = !spec.rank_addresses.empty();
  bool nccl = false;
  if (nccl_ != nullptr && on_gpus) {
    if (multi) {
      nccl = request.nccl_agreed;
    } else {
      // NCCL only when every local rank has a GPU of its own (NCCL refuses two ranks on one).
      std::set<int> devices(spec.local_devices.begin(), spec.local_devices.end());
      nccl = devices.size() == spec.local_devices.size();
    }
  }
  const CollectiveBackend* backend = nullptr;
  if (nccl) {
    backend = nccl_.get();
  } else if (multi) {
    if (remote_ == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", spec.group_id,
                       ": its ranks span several daemons, but this daemon has no "
                       "remote backend (UCX)"));
    }
    backend = remote_.get();
  } else {
    backend = inproc_.get();
  }
  BackendChoice choice;
  choice.backend_name = std::string(backend->Name());
  choice.backend_kind = nccl ? MemoryKind::kCuda : MemoryKind::kHost;
  choice.staged = on_gpus;
  return choice;
}

absl::StatusOr<ConnectedCommunicator> CommunicatorFactory::Connect(
    CommunicatorRequest request) const {
  FS_ASSIGN_OR_RETURN(BackendChoice choice, Choose(request));
  CollectiveBackend& backend = choice.backend_kind == MemoryKind::kCuda ? *nccl_
                               : request.spec.rank_addresses.empty()    ? *inproc_
                                                                        : *remote_;
  // Only an NCCL communicator uses the rendezvous' id.
  if (choice.backend_kind != MemoryKind::kCuda) request.spec.nccl_unique_id.clear();
  ConnectedCommunicator out;
  FS_ASSIGN_OR_RETURN(out.comm, backend.Connect(request.spec));
  if (choice.staged) {
    out.comm =
        MakeStagingCommunicator(std::move(out.comm), choice.backend_kind, request.spec, copier_);
  }
  out.choice = std::move(choice);
  out.spec = std::move(request.spec);
  return out;
}

absl::StatusOr<std::string> CommunicatorFactory::NcclUniqueId() const {
  if (nccl_ == nullptr) {
    return absl::FailedPreconditionError(
        "no NCCL backend on this daemon (no GPU, no NCCL build, or --gpu_collectives=host)");
  }
#if FS_HAVE_NCCL
  return MakeNcclUniqueId();
#else
  return absl::FailedPreconditionError("flatshardd was built without NCCL");
#endif
}

}  // namespace flatshard::collective
