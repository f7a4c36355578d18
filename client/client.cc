#include "flatshard/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/channel_target.h"
#include "client/checkpoint_call.h"
#include "client/client_core.h"
#include "client/client_internal.h"
#include "client/cuda_events.h"
#include "client/group_collectives_call.h"
#include "client/lease_stream.h"
#include "client/ordered_calls.h"
#include "client/plan_layout.h"
#include "client/riding_ends.h"
#include "client/segment_cache.h"
#include "client/shard_views_builder.h"
#include "client/started_calls.h"
#include "client/weights_reader.h"
#include "common/file_util.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/proto_convert.h"
#include "common/status_macros.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "flatshard/v1/shard_service.grpc.pb.h"

namespace flatshard::client {

// --- SummonedParams -------------------------------------------------------------------------

SummonedParams::SummonedParams(std::weak_ptr<internal::ClientCore> core, uint64_t session,
                               std::string module, uint64_t id)
    : core_(std::move(core)), session_(session), module_(std::move(module)), id_(id) {}

SummonedParams::~SummonedParams() {
  if (ended_) return;
  const absl::Status s = End();
  if (!s.ok()) {
    FS_LOG(ERROR) << "summon=" << id_ << " module=\"" << module_
                  << "\": ending it on destruction failed: " << s;
  }
}

absl::Status SummonedParams::End() {
  if (ended_) return end_status_;
  ended_ = true;
  if (std::shared_ptr<internal::ClientCore> core = core_.lock()) {
    end_status_ = core->EndSummon(session_, module_, id_, device_, writeback_, &generation_);
  } else {
    end_status_ = absl::FailedPreconditionError(
        absl::StrCat("summon ", id_, " of module \"", module_,
                     "\": the Client is gone; the daemon ended the summon without writeback"));
  }
  params_ = ParamViews();
  grads_ = ParamViews();
  // The daemon frees a summon's extra buffers when it ends: unmap them now that no view uses
  // them, so that their pages do not outlive the summon (node shared memory).
  if (std::shared_ptr<internal::ClientCore> core = core_.lock()) core->DropUnlinked();
  return end_status_;
}

// --- PendingReduceScatter -------------------------------------------------------------------

PendingReduceScatter::PendingReduceScatter(std::weak_ptr<internal::ClientCore> core,
                                           uint64_t session, std::string module, int32_t unit,
                                           ReduceOp op, bool accumulate)
    : core_(std::move(core)),
      session_(session),
      module_(std::move(module)),
      unit_(unit),
      op_(op),
      accumulate_(accumulate) {}

PendingReduceScatter::~PendingReduceScatter() {
  if (!finished_) {
    FS_LOG(ERROR) << "module=\"" << module_ << "\" unit=" << unit_
                  << ": gradient reduce-scatter begun but never finished; nothing was reduced";
  }
}

absl::Status PendingReduceScatter::Finish() {
  if (finished_) return finish_status_;
  finished_ = true;
  if (std::shared_ptr<internal::ClientCore> core = core_.lock()) {
    finish_status_ = core->FinishReduceScatter(session_, module_, unit_, op_, accumulate_, device_);
  } else {
    finish_status_ = absl::FailedPreconditionError(
        absl::StrCat("module \"", module_, "\" unit ", unit_, ": the Client is gone"));
  }
  return finish_status_;
}

// --- ShardViews -----------------------------------------------------------------------------

ShardViews::ShardViews() = default;
ShardViews::ShardViews(ShardViews&&) noexcept = default;
ShardViews& ShardViews::operator=(ShardViews&&) noexcept = default;
ShardViews::~ShardViews() = default;

const UnitShardView* ShardViews::Find(int32_t unit) const {
  const auto it = std::lower_bound(units_.begin(), units_.end(), unit,
                                   [](const UnitShardView& v, int32_t u) { return v.unit < u; });
  return it != units_.end() && it->unit == unit ? &*it : nullptr;
}

// --- Client ---------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  return internal::ConnectWithGpuApis(std::move(options), internal::GpuApis());
}

namespace internal {

absl::StatusOr<std::unique_ptr<Client>> ConnectWithGpuApis(ClientOptions options, GpuApis apis) {
  FS_ASSIGN_OR_RETURN(options.address, ChannelTarget(options.address));
  if (options.call_timeout <= absl::ZeroDuration() ||
      options.join_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Connect: timeouts must be positive, got call_timeout=",
                     absl::FormatDuration(options.call_timeout),
                     " join_timeout=", absl::FormatDuration(options.join_timeout)));
  }
  if (options.max_attempts < 1 || options.initial_backoff < absl::ZeroDuration() ||
      options.max_backoff < options.initial_backoff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Connect: want max_attempts >= 1 and 0 <= initial_backoff <= max_backoff, got ",
        options.max_attempts, ", ", absl::FormatDuration(options.initial_backoff), ", ",
        absl::FormatDuration(options.max_backoff)));
  }
  grpc::ChannelArguments args;
  // Plans and manifests of large models exceed gRPC's 4 MiB default.
  args.SetMaxReceiveMessageSize(-1);
  FS_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                      ChannelCredentials(options));
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.address, credentials, args);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.call_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach flatshardd at ", options.address,
                                               " within ",
                                               absl::FormatDuration(options.call_timeout)));
  }
  auto core = std::make_shared<ClientCore>(std::move(options), std::move(channel), std::move(apis));
  return ClientCore::NewClient(std::move(core));
}

}  // namespace internal

Client::Client(std::shared_ptr<internal::ClientCore> core) : core_(std::move(core)) {}

Client::~Client() {
  // Objects handed out may still hold the core; the session ends now regardless.
  core_->Shutdown();
}

absl::Status Client::Join(std::string group, int world_size, int rank, std::string token,
                          std::string coordinator) {
  return core_->Join(std::move(group), world_size, rank, std::move(token), std::move(coordinator));
}

std::vector<std::string> Client::registered_modules() const { return core_->registered_modules(); }
std::vector<std::string> Client::lost_modules() const { return core_->lost_modules(); }

absl::StatusOr<RegisteredModule> Client::Register(std::string module,
                                                  absl::string_view manifest_json,
                                                  absl::string_view policy_json, InitMode init) {
  return core_->Register(std::move(module), manifest_json, policy_json, init);
}

absl::StatusOr<std::unique_ptr<SummonedParams>> Client::Summon(const std::string& registered_module,
                                                               const std::string& path,
                                                               const SummonOptions& options) {
  return core_->Summon(registered_module, path, options);
}

absl::StatusOr<std::unique_ptr<SummonedParams>> Client::Summon(
    const std::string& registered_module, const std::string& path, const SummonOptions& options,
    std::unique_ptr<SummonedParams> end_first) {
  SummonedList list;
  list.push_back(std::move(end_first));
  return core_->Summon(registered_module, path, options, std::move(list));
}

absl::StatusOr<std::unique_ptr<SummonedParams>> Client::Summon(const std::string& registered_module,
                                                               const std::string& path,
                                                               const SummonOptions& options,
                                                               SummonedList end_first) {
  return core_->Summon(registered_module, path, options, std::move(end_first));
}

absl::StatusOr<std::unique_ptr<PendingSummon>> Client::StartSummon(
    const std::string& registered_module, const std::string& path, const SummonOptions& options) {
  return core_->StartSummon(registered_module, path, options);
}

absl::StatusOr<std::unique_ptr<PendingSummon>> Client::StartSummon(
    const std::string& registered_module, const std::string& path, const SummonOptions& options,
    std::unique_ptr<SummonedParams> end_first) {
  SummonedList list;
  list.push_back(std::move(end_first));
  return core_->StartSummon(registered_module, path, options, std::move(list));
}

absl::StatusOr<std::unique_ptr<PendingSummon>> Client::StartSummon(
    const std::string& registered_module, const std::string& path, const SummonOptions& options,
    SummonedList end_first) {
  return core_->StartSummon(registered_module, path, options, std::move(end_first));
}

absl::StatusOr<std::unique_ptr<PendingReduceScatter>> Client::BeginReduceScatter(
    const std::string& registered_module, int32_t unit, ReduceOp op, bool accumulate) {
  return core_->BeginReduceScatter(registered_module, unit, op, accumulate);
}

absl::Status Client::ReduceScatterGrads(
    const std::string& registered_module, int32_t unit, ReduceOp op, bool accumulate,
    absl::FunctionRef<absl::Status(PendingReduceScatter&)> fill) {
  FS_ASSIGN_OR_RETURN(std::unique_ptr<PendingReduceScatter> pending,
                      BeginReduceScatter(registered_module, unit, op, accumulate));
  FS_RETURN_IF_ERROR(fill(*pending));
  return pending->Finish();
}

absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> Client::StartFinish(
    std::unique_ptr<PendingReduceScatter> pending) {
  return core_->StartFinish(std::move(pending));
}

absl::StatusOr<ShardViews> Client::GetShardViews(const std::string& registered_module) {
  return core_->GetShardViews(registered_module);
}

absl::StatusOr<uint64_t> Client::Commit(const std::string& registered_module) {
  return core_->Commit(registered_module);
}

absl::StatusOr<ShardViews> Client::RegisterState(const std::string& registered_module,
                                                 const std::vector<StateSpec>& specs) {
  return core_->RegisterState(registered_module, specs);
}

absl::Status Client::Leave() { return core_->Leave(); }

bool Client::joined() const { return core_->joined(); }

absl::Status Client::lease_status() const { return core_->lease_status(); }

int64_t Client::segment_map_calls() const { return core_->map_calls(); }

int64_t Client::ipc_open_calls() const { return core_->ipc_open_calls(); }

const ClientOptions& Client::options() const { return core_->options(); }

absl::Status Client::AllReduce(float* values, size_t count, ValuesReduceOp op) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  return internal::AllReduceCall(core_->channel(), caller, values, count, sizeof(float), op,
                                 core_->options().call_timeout);
}

absl::Status Client::AllReduce(double* values, size_t count, ValuesReduceOp op) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  return internal::AllReduceCall(core_->channel(), caller, values, count, sizeof(double), op,
                                 core_->options().call_timeout);
}

absl::Status Client::Broadcast(void* data, size_t bytes, int root) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  return internal::BroadcastCall(core_->channel(), caller, data, bytes, root,
                                 core_->options().call_timeout);
}

absl::StatusOr<PublishedVersion> Client::Publish(const std::string& registered_module,
                                                 const std::string& name,
                                                 const PublishOptions& options) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  return internal::PublishCall(core_->channel(), caller, registered_module, name, options,
                               core_->options().call_timeout);
}

absl::StatusOr<Client::CheckpointInfo> Client::SaveCheckpoint(
    const std::string& registered_module, const std::string& dir,
    const CheckpointProgressFn& progress) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  v1::SaveCheckpointRequest request;
  request.set_group(caller.group());
  request.set_module(registered_module);
  request.set_dir(dir);
  return internal::SaveCheckpointCall(core_->channel(), request, progress);
}

absl::StatusOr<Client::CheckpointInfo> Client::LoadCheckpoint(
    const std::string& registered_module, const std::string& dir,
    const CheckpointProgressFn& progress) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  v1::LoadCheckpointRequest request;
  request.set_group(caller.group());
  request.set_module(registered_module);
  request.set_dir(dir);
  return internal::LoadCheckpointCall(core_->channel(), request, progress);
}

absl::StatusOr<Client::CheckpointInfo> Client::ImportSafetensors(
    const std::string& registered_module, const std::string& file,
    const CheckpointProgressFn& progress) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, core_->SessionCaller());
  v1::LoadCheckpointRequest request;
  request.set_group(caller.group());
  request.set_module(registered_module);
  request.set_safetensors(file);
  return internal::LoadCheckpointCall(core_->channel(), request, progress);
}

}  // namespace flatshard::client
