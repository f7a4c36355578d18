#include "server/publish/device_versions.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/gpu/device_context.h"
#include "server/shard_store.h"

namespace flatshard::server {

DeviceVersions::DeviceVersions(ShardStore* store,
                               std::vector<std::shared_ptr<gpu::DeviceContext>> gpus)
    : store_(store), gpus_(std::move(gpus)) {}

gpu::DeviceContext* DeviceVersions::Find(int device) const {
  for (const auto& g : gpus_) {
    if (g != nullptr && g->device() == device) return g.get();
  }
  return nullptr;
}

absl::Status DeviceVersions::Check(const std::string& name, int device,
                                   const std::vector<int64_t>& reader_uids,
                                   const std::string& reader_token) const {
  const std::string what = absl::StrCat("Publish of weights \"", name, "\" to GPU ", device);
  if (device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Publish: options.device must be a GPU ordinal >= 0, got ", device));
  }
  // A CUDA IPC handle opens the whole slab read-write: only the publisher's uid may hold it.
  if (!reader_uids.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": options.reader_uids must be empty (a device version is read by the "
                     "publisher's uid only: CUDA IPC maps device memory read-write)"));
  }
  if (!reader_token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": options.reader_token must be empty (a device version is read by the "
                     "publisher's uid only: CUDA IPC maps device memory read-write)"));
  }
  if (Find(device) == nullptr) {
    std::vector<int> have;
    for (const auto& g : gpus_) {
      if (g != nullptr) have.push_back(g->device());
    }
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": this daemon does not use GPU ", device, " (its GPUs: ",
        have.empty() ? std::string("none; see --gpus") : absl::StrJoin(have, ", "), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Buffer>> DeviceVersions::Upload(const Buffer& host, int device,
                                                               const std::string& label,
                                                               int64_t owner_uid) const {
  gpu::DeviceContext* context = Find(device);
  if (context == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(label, ": this daemon does not use GPU ", device));
  }
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> out,
                      store_->Allocate(BufferKind::kStaging, host.bytes(), label, owner_uid,
                                       Placement::Device(device)));
  if (host.bytes() > 0) {
    FS_RETURN_IF_ERROR(context->Copy(out->data(), host.data(), static_cast<size_t>(host.bytes())));
  }
  return out;
}

}  // namespace flatshard::server
