#include "client/client_core.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/channel_target.h"
#include "client/checkpoint_call.h"
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

namespace flatshard::client::internal {
namespace {

// The public API keeps its own InitMode, ReduceOp and SummonOptions (client.h may not include
// the uninstalled common/rpc_types.h); they are the RPC types value for value, and their wire
// mapping is proto_convert's.
static_assert(static_cast<int>(InitMode::kZeros) == static_cast<int>(flatshard::InitMode::kZeros) &&
              static_cast<int>(InitMode::kFromEveryRank) ==
                  static_cast<int>(flatshard::InitMode::kFromEveryRank) &&
              static_cast<int>(InitMode::kFromRank0) ==
                  static_cast<int>(flatshard::InitMode::kFromRank0));
static_assert(static_cast<int>(ReduceOp::kSum) == static_cast<int>(flatshard::ReduceOp::kSum) &&
              static_cast<int>(ReduceOp::kAvg) == static_cast<int>(flatshard::ReduceOp::kAvg));
static_assert(sizeof(SummonOptions) == sizeof(flatshard::SummonOptions),
              "client::SummonOptions and flatshard::SummonOptions must have the same fields");

v1::InitMode ToProto(InitMode mode) {
  return flatshard::ToProto(static_cast<flatshard::InitMode>(mode));
}

v1::ReduceOp ToProto(ReduceOp op) {
  return flatshard::ToProto(static_cast<flatshard::ReduceOp>(op));
}

v1::SummonOptions ToProto(const SummonOptions& o) {
  return flatshard::ToProto(flatshard::SummonOptions{
      o.recurse, o.writeback, o.rank0_only, o.offload_to_cpu, o.with_grads, o.compute_precision});
}

static_assert(static_cast<int>(StateShape::kShard) ==
                  static_cast<int>(flatshard::StateShape::kShard) &&
              static_cast<int>(StateShape::kScalar) ==
                  static_cast<int>(flatshard::StateShape::kScalar));

flatshard::StateSpec ToCommon(const StateSpec& s) {
  return flatshard::StateSpec{s.name, s.dtype, static_cast<flatshard::StateShape>(s.shape)};
}

// The lane key of a unit's started phase twos (StartFinish): BeginReduceScatter of the unit
// waits for them, and only them.
std::string FinishKey(const std::string& module, int32_t unit) {
  return absl::StrCat(unit, ":", module);
}

// A fraction in [0.5, 1] of `backoff`, so that ranks retrying together spread out.
absl::Duration Jittered(absl::Duration backoff) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return backoff * std::uniform_real_distribution<double>(0.5, 1.0)(rng);
}

}  // namespace

template <typename Request, typename Response>
absl::Status ClientCore::Call(absl::string_view name, UnaryMethod<Request, Response> method,
                              const Request& request, Response* response, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    const bool connected = channel_->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
    const absl::Status status = FromGrpcStatus((stub_.get()->*method)(&context, request, response));
    if (status.ok() || status.code() != absl::StatusCode::kUnavailable ||
        attempt >= options_.max_attempts) {
      return status;
    }
    if (context.GetServerTrailingMetadata().count(kDaemonAnswerKey) != 0 || connected) {
      FS_VLOG(1) << name << ": not retried (the "
                 << (connected ? "request may have reached" : "answer came from")
                 << " the daemon): " << status;
      return status;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return status;
    FS_VLOG(1) << name << " attempt " << attempt << " failed, retrying: " << status;
    absl::SleepFor(std::min(Jittered(backoff), left));
    backoff = std::min(backoff * 2, options_.max_backoff);
    response->Clear();
  }
}

ClientCore::~ClientCore() {
  ordered_.Stop();  // summons still queued find the core gone and fail FAILED_PRECONDITION
  Shutdown();
}

std::unique_ptr<Client> ClientCore::NewClient(std::shared_ptr<ClientCore> core) {
  return std::unique_ptr<Client>(new Client(std::move(core)));
}

absl::StatusOr<v1::Caller> ClientCore::SessionCaller() const {
  ordered_.Drain();
  return CurrentCaller(0);
}

void ClientCore::DropUnlinked() {
  if (const size_t n = cache_.DropUnlinked(); n > 0) {
    FS_VLOG(2) << "unmapped " << n << " segments the daemon freed";
  }
}

void ClientCore::Shutdown() {
  std::unique_ptr<LeaseStream> lease;
  {
    absl::MutexLock lock(&mu_);
    lease = std::move(lease_);
    state_ = State::kIdle;
    modules_.clear();
    shard_device_ = -1;
  }
  if (lease != nullptr) lease->Stop(LeaseEndWait());
}

absl::Duration ClientCore::LeaseEndWait() const {
  return std::min(options_.call_timeout, absl::Seconds(5));
}

absl::Status ClientCore::Join(std::string group, int world_size, int rank, std::string token,
                              std::string coordinator) {
  ordered_.Drain();
  if (group.empty()) return absl::InvalidArgumentError("Join: empty group name");
  FS_RETURN_IF_ERROR(CheckLength("Join", "group", group, kMaxGroupBytes));
  FS_RETURN_IF_ERROR(CheckLength("Join", "token", token, kMaxTokenBytes));
  FS_RETURN_IF_ERROR(CheckLength("Join", "coordinator", coordinator, kMaxAddressBytes));
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("Join: rank ", rank, " of world_size ",
                                                   world_size, ": want 0 <= rank < world_size"));
  }
  std::unique_ptr<LeaseStream> broken;
  {
    absl::MutexLock lock(&mu_);
    const bool lease_alive = lease_ != nullptr && lease_->status().ok();
    if (state_ == State::kJoining || state_ == State::kLeaving ||
        (state_ == State::kJoined && lease_alive)) {
      return absl::FailedPreconditionError(absl::StrCat("Join: already joined or joining (",
                                                        SessionLabel(caller_), "); Leave first"));
    }
    // A session whose lease broke is over at the daemon: joining again replaces it.
    broken = std::move(lease_);
    state_ = State::kJoining;
    modules_.clear();
    shard_device_ = -1;
  }
  if (broken != nullptr) broken->Stop();
  absl::Status status =
      JoinAndLease(std::move(group), world_size, rank, std::move(token), std::move(coordinator));
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    state_ = State::kIdle;
  }
  return status;
}

std::vector<std::string> ClientCore::registered_modules() const {
  absl::MutexLock lock(&mu_);
  return registered_modules_;
}

std::vector<std::string> ClientCore::lost_modules() const {
  absl::MutexLock lock(&mu_);
  return lost_modules_;
}

absl::StatusOr<RegisteredModule> ClientCore::Register(std::string module,
                                                      absl::string_view manifest_json,
                                                      absl::string_view policy_json,
                                                      InitMode init) {
  ordered_.Drain();
  FS_RETURN_IF_ERROR(CheckLength("Register", "module", module, kMaxModulePathBytes));
  // Parsing here gives bad input the exact messages of the JSON readers, before any RPC.
  FS_ASSIGN_OR_RETURN(Manifest manifest, ManifestFromJson(manifest_json));
  FS_ASSIGN_OR_RETURN(Policy policy, PolicyFromJson(policy_json));
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  DropUnlinked();
  v1::RegisterModuleRequest request;
  *request.mutable_caller() = caller;
  request.set_module(module);
  *request.mutable_manifest() = flatshard::ToProto(manifest);
  *request.mutable_policy() = flatshard::ToProto(policy);
  request.set_init(internal::ToProto(init));
  v1::RegisterModuleResponse response;
  FS_RETURN_IF_ERROR(
      Call("RegisterModule", &Stub::RegisterModule, request, &response, options_.call_timeout));

  absl::StatusOr<Plan> plan = flatshard::FromProto(response.plan());
  if (!plan.ok()) {
    return absl::InternalError(absl::StrCat(
        "module \"", module, "\": the daemon sent an invalid plan: ", plan.status().message()));
  }
  absl::StatusOr<std::shared_ptr<const ModuleLayout>> layout =
      ModuleLayout::Create(std::make_shared<const Plan>(*std::move(plan)));
  if (!layout.ok()) {
    return absl::InternalError(
        absl::StrCat("module \"", module, "\": unusable plan: ", layout.status().message()));
  }
  {
    // Registered at the daemon: Summon works from now on, even if building views fails.
    absl::MutexLock lock(&mu_);
    if (state_ == State::kJoined && caller_.session() == caller.session()) {
      modules_[module] = *layout;
    }
  }
  absl::StatusOr<PlanLayout> public_layout = MakePlanLayout((*layout)->plan(), caller.rank());
  if (!public_layout.ok()) {
    return absl::InternalError(
        absl::StrCat("module \"", module, "\": unusable plan: ", public_layout.status().message()));
  }
  RegisteredModule out;
  out.module = module;
  out.plan = (*layout)->shared_plan();
  out.layout = std::make_shared<const PlanLayout>(*std::move(public_layout));
  // The init summon first: if the shard views fail, its destructor still ends it.
  if (response.has_init_summon()) {
    FS_ASSIGN_OR_RETURN(out.init_summon,
                        MakeSummoned(*layout, caller, module, response.init_summon(),
                                     /*writable=*/true));
  }
  FS_ASSIGN_OR_RETURN(out.shards,
                      MakeShardViews(**layout, caller, response.shards(), response.state_specs()));
  out.shards.generation_ = response.generation();
  out.generation = response.generation();
  return out;
}

absl::StatusOr<std::unique_ptr<SummonedParams>> ClientCore::Summon(const std::string& module,
                                                                   const std::string& path,
                                                                   const SummonOptions& options,
                                                                   SummonedList end_first) {
  ordered_.Drain();
  FS_ASSIGN_OR_RETURN(PreparedSummon prepared,
                      PrepareSummon(module, path, options, std::move(end_first)));
  return CallSummon(prepared);
}

absl::StatusOr<std::unique_ptr<PendingSummon>> ClientCore::StartSummon(const std::string& module,
                                                                       const std::string& path,
                                                                       const SummonOptions& options,
                                                                       SummonedList end_first) {
  FS_ASSIGN_OR_RETURN(PreparedSummon prepared,
                      PrepareSummon(module, path, options, std::move(end_first)));
  auto job = std::make_shared<SummonJob>();
  ordered_.Submit([weak = weak_from_this(), job, prepared = std::move(prepared)] {
    absl::StatusOr<std::unique_ptr<SummonedParams>> result = absl::FailedPreconditionError(
        absl::StrCat("Summon of module \"", prepared.request.registered_module(), "\" path \"",
                     prepared.request.path(), "\": the Client is gone"));
    if (std::shared_ptr<ClientCore> core = weak.lock()) result = core->CallSummon(prepared);
    absl::MutexLock lock(&job->mu);
    job->result = std::move(result);
    job->done = true;
  });
  return std::unique_ptr<PendingSummon>(new PendingSummon(std::move(job)));
}

absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> ClientCore::StartFinish(
    std::unique_ptr<PendingReduceScatter> pending) {
  if (pending == nullptr || pending->finished_) {
    return absl::FailedPreconditionError(
        "StartFinish: the reduce-scatter is null or already finished");
  }
  const int32_t unit = pending->unit();
  std::string key = FinishKey(pending->module_, unit);
  auto job = std::make_shared<FinishJob>();
  std::shared_ptr<PendingReduceScatter> owned = std::move(pending);
  ordered_.Submit(
      [job, owned] {
        const absl::Status status = owned->Finish();
        absl::MutexLock lock(&job->mu);
        job->status = status;
        job->done = true;
      },
      std::move(key));
  return std::unique_ptr<FinishingReduceScatter>(new FinishingReduceScatter(job, unit));
}

absl::StatusOr<ClientCore::PreparedSummon> ClientCore::PrepareSummon(const std::string& module,
                                                                     const std::string& path,
                                                                     const SummonOptions& options,
                                                                     SummonedList end_first) {
  PreparedSummon out;
  absl::Status s = out.end_first.Take(
      std::move(end_first),
      [this](const SummonedParams& p) {
        return p.core_.lock().get() == this && CurrentCaller(p.session_).ok();
      },
      PlainEnd());
  if (s.ok()) s = FillSummon(module, path, options, &out);
  if (!s.ok()) {
    // Summons the caller gave up must not stay open, whatever follows.
    out.end_first.EndEach(PlainEnd());
    return s;
  }
  return out;
}

RidingEnds::EndFn ClientCore::PlainEnd() {
  return [this](uint64_t session, const std::string& module, uint64_t summon, int device) {
    std::optional<uint64_t> unused;
    return EndSummon(session, module, summon, device, /*writeback=*/false, &unused);
  };
}

absl::Status ClientCore::FillSummon(const std::string& module, const std::string& path,
                                    const SummonOptions& options, PreparedSummon* prepared) {
  PreparedSummon& out = *prepared;
  FS_RETURN_IF_ERROR(CheckLength("Summon", "path", path, kMaxModulePathBytes));
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  FS_ASSIGN_OR_RETURN(out.layout, FindModule(module));
  if (options.compute_precision) out.layout = ModuleLayout::Compute(out.layout);
  out.writeback = options.writeback;
  v1::SummonRequest& request = out.request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  request.set_path(path);
  *request.mutable_options() = internal::ToProto(options);
  // Device shards may have been written on the trainer's stream (an optimizer step) since
  // the last call: the daemon's all-gather must wait for that. The riding Ends use the same
  // event (the trainer's stream done with their views), recorded for them alone when only
  // they have device memory.
  int device = ShardDevice();
  if (device < 0) device = out.end_first.device();
  if (device >= 0) {
    absl::StatusOr<IpcEvent> written = events_.RecordWritten(device, options_.cuda_stream);
    if (!written.ok()) {
      return absl::Status(written.status().code(),
                          absl::StrCat("Summon of module \"", module, "\" path \"", path,
                                       "\": ", written.status().message()));
    }
    *request.mutable_written() = flatshard::ToProto(*written);
  }
  out.end_first.AddTo(&request);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SummonedParams>> ClientCore::CallSummon(
    const PreparedSummon& prepared) {
  DropUnlinked();  // views dropped since the last call (e.g. ShardViews) free theirs now
  v1::SummonResponse response;
  // The transition lane when it takes the request (one stream message, cheaper than a call),
  // the unary call otherwise; the daemon runs both alike.
  std::optional<absl::Status> on_lane =
      lane_.Summon(prepared.request, &response, options_.call_timeout);
  if (absl::Status s = on_lane.has_value() ? *on_lane
                                           : Call("Summon", &Stub::Summon, prepared.request,
                                                  &response, options_.call_timeout);
      !s.ok()) {
    prepared.end_first.EndEach(PlainEnd());
    return s;
  }
  const std::string& module = prepared.request.registered_module();
  FS_VLOG(2) << "summon=" << response.summon() << " module=\"" << module << "\" path=\""
             << prepared.request.path() << "\" units=" << response.unit_indices_size();
  return MakeSummoned(prepared.layout, prepared.request.caller(), module, response,
                      prepared.writeback);
}

absl::Status ClientCore::EndSummon(uint64_t session, const std::string& module, uint64_t summon,
                                   int device, bool writeback,
                                   std::optional<uint64_t>* generation) {
  if (writeback) ordered_.Drain();
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(session));
  v1::EndSummonRequest request;
  *request.mutable_caller() = caller;
  request.set_summon(summon);
  if (device >= 0) {
    // Without the event the daemon could write back before the trainer's writes landed;
    // better to fail (the summon then ends with the session) than to write back garbage.
    absl::StatusOr<IpcEvent> written = events_.RecordWritten(device, options_.cuda_stream);
    if (!written.ok()) {
      return absl::Status(written.status().code(),
                          absl::StrCat("EndSummon of summon ", summon, " module \"", module,
                                       "\": ", written.status().message()));
    }
    *request.mutable_written() = flatshard::ToProto(*written);
  }
  v1::EndSummonResponse response;
  absl::Status s = Call("EndSummon", &Stub::EndSummon, request, &response, options_.call_timeout);
  if (s.ok() && response.has_generation()) *generation = response.generation();
  FS_VLOG(2) << "end summon=" << summon << " module=\"" << module << "\": " << s;
  return s;
}

absl::StatusOr<std::unique_ptr<PendingReduceScatter>> ClientCore::BeginReduceScatter(
    const std::string& module, int32_t unit, ReduceOp op, bool accumulate) {
  // Phase one runs no collective and changes no group state, so it need not wait for the
  // started summons and other units' phase twos (which would expose their collectives on
  // the backward's critical path). Only the unit's own started phase two must be done: a
  // Begin that reached the daemon before it would be handed the buffer it then reduces.
  ordered_.DrainKey(FinishKey(module, unit));
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  FS_ASSIGN_OR_RETURN(std::shared_ptr<const ModuleLayout> layout, FindModule(module));
  layout = ModuleLayout::Reduce(layout);  // the gradient comes in the unit's reduce dtype
  const UnitTemplate* tmpl = layout->FindUnit(unit);
  if (tmpl == nullptr) {
    return absl::NotFoundError(absl::StrCat("module \"", module, "\" has no unit ", unit));
  }
  v1::ReduceScatterGradsRequest request =
      ReduceScatterRequest(caller, module, unit, op, accumulate, /*begin=*/true);
  v1::ReduceScatterGradsResponse response;
  FS_RETURN_IF_ERROR(Call("ReduceScatterGrads(begin)", &Stub::ReduceScatterGrads, request,
                          &response, options_.call_timeout));
  FS_ASSIGN_OR_RETURN(MappedRange range,
                      cache_.Map(ToRange(response.full_grad()), /*writable=*/true));
  FS_RETURN_IF_ERROR(CheckRangeHolds(range, tmpl->padded_numel, tmpl->dtype,
                                     absl::StrCat("unit ", unit, " full gradient")));
  ViewBuilder builder(layout);
  FS_RETURN_IF_ERROR(builder.AddUnit(unit, range));
  std::unique_ptr<PendingReduceScatter> pending(
      new PendingReduceScatter(weak_from_this(), caller.session(), module, unit, op, accumulate));
  pending->dtype_ = tmpl->dtype;
  pending->data_ = range.data;
  pending->numel_ = tmpl->padded_numel;
  pending->device_ = range.device;
  pending->grads_ = builder.Build();
  return pending;
}

absl::Status ClientCore::FinishReduceScatter(uint64_t session, const std::string& module,
                                             int32_t unit, ReduceOp op, bool accumulate,
                                             int device) {
  ordered_.Drain();
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(session));
  v1::ReduceScatterGradsRequest request =
      ReduceScatterRequest(caller, module, unit, op, accumulate, /*begin=*/false);
  const auto where = [&] {
    return absl::StrCat("ReduceScatterGrads of module \"", module, "\" unit ", unit, ": ");
  };
  if (device >= 0) {
    absl::StatusOr<IpcEvent> written = events_.RecordWritten(device, options_.cuda_stream);
    if (!written.ok()) {
      return absl::Status(written.status().code(),
                          absl::StrCat(where(), written.status().message()));
    }
    *request.mutable_written() = flatshard::ToProto(*written);
  }
  v1::ReduceScatterGradsResponse response;
  FS_RETURN_IF_ERROR(Call("ReduceScatterGrads", &Stub::ReduceScatterGrads, request, &response,
                          options_.call_timeout));
  // The optimizer reads the gradient shard on the trainer's stream next.
  if (device >= 0 && response.has_ready()) {
    if (absl::Status s =
            events_.WaitReady(flatshard::FromProto(response.ready()), options_.cuda_stream);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(where(), s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardViews> ClientCore::GetShardViews(const std::string& module) {
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  FS_ASSIGN_OR_RETURN(std::shared_ptr<const ModuleLayout> layout, FindModule(module));
  DropUnlinked();
  v1::GetShardViewsRequest request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  v1::GetShardViewsResponse response;
  FS_RETURN_IF_ERROR(
      Call("GetShardViews", &Stub::GetShardViews, request, &response, options_.call_timeout));
  FS_ASSIGN_OR_RETURN(ShardViews views,
                      MakeShardViews(*layout, caller, response.shards(), response.state_specs()));
  views.generation_ = response.generation();
  return views;
}

absl::StatusOr<ShardViews> ClientCore::RegisterState(const std::string& module,
                                                     const std::vector<StateSpec>& specs) {
  ordered_.Drain();
  std::vector<flatshard::StateSpec> common;
  for (const StateSpec& s : specs) common.push_back(ToCommon(s));
  if (absl::Status s = ValidateStateSpecs(common); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterState of module \"", module, "\": ", s.message()));
  }
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  FS_ASSIGN_OR_RETURN(std::shared_ptr<const ModuleLayout> layout, FindModule(module));
  DropUnlinked();
  v1::RegisterStateRequest request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  for (const flatshard::StateSpec& s : common) *request.add_specs() = flatshard::ToProto(s);
  v1::RegisterStateResponse response;
  FS_RETURN_IF_ERROR(
      Call("RegisterState", &Stub::RegisterState, request, &response, options_.call_timeout));
  FS_ASSIGN_OR_RETURN(ShardViews views,
                      MakeShardViews(*layout, caller, response.shards(), response.state_specs()));
  views.generation_ = response.generation();
  FS_VLOG(1) << "module=\"" << module << "\": optimizer state "
             << (response.created() ? "allocated" : "re-attached") << " at generation "
             << response.generation();
  return views;
}

absl::StatusOr<uint64_t> ClientCore::Commit(const std::string& module) {
  ordered_.Drain();
  FS_ASSIGN_OR_RETURN(v1::Caller caller, CurrentCaller(0));
  FS_ASSIGN_OR_RETURN(std::shared_ptr<const ModuleLayout> layout, FindModule(module));
  v1::CommitRequest request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  // Device shards: the optimizer's writes on the trainer's stream land before the daemon
  // copies the shards into the committed generation.
  if (const int device = ShardDevice(); device >= 0) {
    absl::StatusOr<IpcEvent> written = events_.RecordWritten(device, options_.cuda_stream);
    if (!written.ok()) {
      return absl::Status(
          written.status().code(),
          absl::StrCat("Commit of module \"", module, "\": ", written.status().message()));
    }
    *request.mutable_written() = flatshard::ToProto(*written);
  }
  v1::CommitResponse response;
  FS_RETURN_IF_ERROR(Call("Commit", &Stub::Commit, request, &response, options_.call_timeout));
  FS_VLOG(2) << "commit module=\"" << module << "\": generation " << response.generation();
  return response.generation();
}

absl::Status ClientCore::Leave() {
  ordered_.Drain();
  std::unique_ptr<LeaseStream> lease;
  v1::Caller caller;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kJoined) {
      return absl::FailedPreconditionError("Leave: not joined to a group");
    }
    state_ = State::kLeaving;
    caller = caller_;
    lease = std::move(lease_);
  }
  v1::LeaveRequest request;
  *request.mutable_caller() = caller;
  v1::LeaveResponse response;
  const absl::Status status =
      Call("Leave", &Stub::Leave, request, &response, options_.call_timeout);
  if (lease != nullptr) lease->Stop(LeaseEndWait());
  {
    absl::MutexLock lock(&mu_);
    state_ = State::kIdle;
    modules_.clear();
    shard_device_ = -1;
  }
  cache_.Clear();
  events_.ForgetOpened();
  FS_LOG(INFO) << "left " << SessionLabel(caller) << ": " << status;
  return status;
}

bool ClientCore::joined() const {
  absl::MutexLock lock(&mu_);
  return state_ == State::kJoined;
}

absl::Status ClientCore::lease_status() const {
  absl::MutexLock lock(&mu_);
  return lease_ == nullptr ? absl::OkStatus() : lease_->status();
}

absl::Status ClientCore::JoinAndLease(std::string group, int world_size, int rank,
                                      std::string token, std::string coordinator) {
  v1::JoinGroupRequest request;
  request.set_coordinator(std::move(coordinator));
  request.set_group(group);
  request.set_world_size(world_size);
  request.set_rank(rank);
  request.set_token(token);
  v1::JoinGroupResponse response;
  FS_RETURN_IF_ERROR(
      Call("JoinGroup", &Stub::JoinGroup, request, &response, options_.join_timeout));
  v1::Caller caller;
  caller.set_group(std::move(group));
  caller.set_rank(rank);
  caller.set_token(std::move(token));
  caller.set_session(response.session());
  auto lease = std::make_unique<LeaseStream>(stub_.get(), caller);
  if (absl::Status s = lease->WaitStarted(options_.call_timeout); !s.ok()) {
    lease->Stop();
    // Without a lease the daemon may keep the session until its own timeout: say goodbye.
    v1::LeaveRequest leave;
    *leave.mutable_caller() = caller;
    v1::LeaveResponse ignored;
    const absl::Status left = Call("Leave", &Stub::Leave, leave, &ignored, options_.call_timeout);
    if (!left.ok()) FS_LOG(WARNING) << "leaving " << SessionLabel(caller) << ": " << left;
    return s;
  }
  cache_.Clear();  // a new session may come from a restarted daemon
  events_.ForgetOpened();
  {
    absl::MutexLock lock(&mu_);
    caller_ = caller;
    lease_ = std::move(lease);
    registered_modules_.assign(response.registered_modules().begin(),
                               response.registered_modules().end());
    lost_modules_.assign(response.lost_modules().begin(), response.lost_modules().end());
    state_ = State::kJoined;
  }
  FS_LOG(INFO) << "joined " << SessionLabel(caller) << " world_size=" << world_size << " via "
               << options_.address;
  return absl::OkStatus();
}

absl::StatusOr<v1::Caller> ClientCore::CurrentCaller(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kJoined) {
    return absl::FailedPreconditionError(
        session == 0 ? "not joined to a group: call Join first"
                     : absl::StrCat("session ", session, " is over (Leave or Client gone)"));
  }
  if (session != 0 && caller_.session() != session) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session, " is over; the current one is ", caller_.session()));
  }
  if (lease_ != nullptr) {
    if (absl::Status lease = lease_->status(); !lease.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the lease of ", SessionLabel(caller_),
                       " ended, so the daemon ended the session (Join again): ", lease.ToString()));
    }
  }
  return caller_;
}

int ClientCore::ShardDevice() const {
  absl::MutexLock lock(&mu_);
  return shard_device_;
}

absl::StatusOr<std::shared_ptr<const ModuleLayout>> ClientCore::FindModule(
    const std::string& module) const {
  absl::MutexLock lock(&mu_);
  const auto it = modules_.find(module);
  if (it == modules_.end()) {
    return absl::NotFoundError(
        absl::StrCat("module \"", module, "\" was not registered by this client in this session"));
  }
  return it->second;
}

v1::ReduceScatterGradsRequest ClientCore::ReduceScatterRequest(const v1::Caller& caller,
                                                               const std::string& module,
                                                               int32_t unit, ReduceOp op,
                                                               bool accumulate, bool begin) {
  v1::ReduceScatterGradsRequest request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  request.set_unit(unit);
  request.set_op(internal::ToProto(op));
  request.set_accumulate(accumulate);
  request.set_begin(begin);
  return request;
}

absl::StatusOr<std::unique_ptr<SummonedParams>> ClientCore::MakeSummoned(
    std::shared_ptr<const ModuleLayout> layout, const v1::Caller& caller, const std::string& module,
    const v1::SummonResponse& response, bool writable) {
  std::unique_ptr<SummonedParams> summoned(
      new SummonedParams(weak_from_this(), caller.session(), module, response.summon()));
  summoned->writeback_ = writable;
  summoned->units_.assign(response.unit_indices().begin(), response.unit_indices().end());
  summoned->note_ = response.note();
  ViewBuilder params(layout);
  ViewBuilder grads(layout);
  int device = -1;  // of the device views, if any
  absl::Status built = absl::OkStatus();
  for (const v1::UnitView& unit : response.units()) {
    absl::StatusOr<MappedRange> p = cache_.Map(ToRange(unit.params()), writable);
    built = p.ok() ? params.AddUnit(unit.unit(), *p) : p.status();
    if (built.ok() && p->device >= 0) device = p->device;
    if (built.ok() && unit.has_grads()) {
      absl::StatusOr<MappedRange> g = cache_.Map(ToRange(unit.grads()), writable);
      built = g.ok() ? grads.AddUnit(unit.unit(), *g) : g.status();
      if (built.ok() && g->device >= 0) device = g->device;
    }
    if (!built.ok()) break;
  }
  // Device views: the trainer's stream must not read them before the daemon's all-gather
  // has filled them. Host-only summons never touch CUDA.
  if (built.ok() && device >= 0 && response.has_ready()) {
    built = events_.WaitReady(flatshard::FromProto(response.ready()), options_.cuda_stream);
  }
  if (!built.ok()) {
    // The daemon holds the units summoned until EndSummon: end it before failing. The
    // trainer wrote nothing, so End sends no `written` (device_ is still -1).
    const absl::Status ended = summoned->End();
    if (!ended.ok()) {
      FS_LOG(ERROR) << "summon=" << response.summon() << " module=\"" << module
                    << "\": ending it after a failed view setup: " << ended;
    }
    return built;
  }
  summoned->device_ = device;
  summoned->params_ = params.Build();
  summoned->grads_ = grads.Build();
  return summoned;
}

absl::StatusOr<ShardViews> ClientCore::MakeShardViews(
    const ModuleLayout& layout, const v1::Caller& caller,
    const google::protobuf::RepeatedPtrField<v1::UnitShard>& shards,
    const google::protobuf::RepeatedPtrField<v1::StateSpec>& state_specs) {
  FS_ASSIGN_OR_RETURN(ShardViews out,
                      ShardViewsBuilder::Build(layout, caller.rank(), shards, state_specs, cache_));
  // From now on the trainer may write device shards (optimizer steps): Summon sends
  // `written` so the daemon reads them only after those writes.
  for (const UnitShardView& view : out) {
    if (view.device < 0) continue;
    absl::MutexLock lock(&mu_);
    if (state_ == State::kJoined && caller_.session() == caller.session()) {
      shard_device_ = view.device;
    }
    break;
  }
  return out;
}

}  // namespace flatshard::client::internal
