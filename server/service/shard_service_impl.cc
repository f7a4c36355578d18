#include "server/service/shard_service_impl.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/proto_convert.h"
#include "server/access/access_control.h"
#include "server/metrics/metered_reactor.h"

namespace flatshard::server {
namespace {

Caller FromProto(const v1::Caller& c) { return Caller{c.group(), c.rank(), c.token(), c.session()}; }

// Answers a call its caller may not make (access control) and returns the reactor.
template <typename Reactor>
Reactor* Refuse(Reactor* reactor, const absl::Status& status) {
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void FillHandle(const Buffer& b, v1::MemoryHandle* h) {
  h->set_segment(b.segment_name());
  h->set_segment_bytes(static_cast<uint64_t>(b.segment_bytes()));
  h->set_offset(static_cast<uint64_t>(b.offset()));
  h->set_bytes(static_cast<uint64_t>(b.bytes()));
  if (b.on_device()) {
    v1::CudaMemory* cuda = h->mutable_cuda();
    cuda->set_ipc_handle(b.ipc_handle());
    cuda->set_device_uuid(b.device_uuid());
    cuda->set_device(b.placement().device);
  }
}

void FillEvent(const gpu::IpcEventRef& e, v1::CudaEvent* out) {
  out->set_id(e.id);
  out->set_ipc_handle(e.ipc_handle);
  out->set_device_uuid(e.device_uuid);
}

gpu::IpcEventRef EventOf(const v1::CudaEvent& e) {
  return gpu::IpcEventRef{e.id(), e.ipc_handle(), e.device_uuid()};
}

void FillShards(const std::vector<UnitShard>& shards,
                google::protobuf::RepeatedPtrField<v1::UnitShard>* out) {
  for (const UnitShard& s : shards) {
    v1::UnitShard* u = out->Add();
    u->set_unit(s.unit);
    FillHandle(*s.shard, u->mutable_shard());
    if (s.grad) FillHandle(*s.grad, u->mutable_grad());
  }
}

void FillSummon(const SummonResult& result, v1::SummonResponse* response) {
  response->set_summon(result.summon);
  for (int32_t u : result.units) response->add_unit_indices(u);
  for (const SummonedUnit& v : result.views) {
    v1::UnitView* view = response->add_units();
    view->set_unit(v.unit);
    if (v.params) FillHandle(*v.params, view->mutable_params());
    if (v.grads) FillHandle(*v.grads, view->mutable_grads());
  }
  response->set_note(result.note);
  if (result.ready.id != 0) FillEvent(result.ready, response->mutable_ready());
}

// Holds the session's lease: the stream stays open while the client lives. Its end, however it
// comes (half-close, broken connection, cancellation), ends the session exactly once.
class LeaseReactor final : public grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse> {
 public:
  // `uid`: the caller's uid, or why it may not call (answered to its first message).
  LeaseReactor(GroupManager* groups, absl::StatusOr<int64_t> uid)
      : groups_(groups), uid_(std::move(uid)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(grpc::Status::OK);
      return;
    }
    if (!attached_) {
      caller_ = FromProto(request_.caller());
      caller_.uid = uid_.ok() ? *uid_ : access::kRemoteUid;
      absl::Status s = uid_.ok() ? groups_->CheckCaller(caller_) : uid_.status();
      if (!s.ok()) {
        if (!finished_.exchange(true)) Finish(ToGrpcStatus(s));
        return;
      }
      attached_ = true;
    }
    StartRead(&request_);
  }
  void OnCancel() override { End(grpc::Status::CANCELLED); }
  void OnDone() override {
    EndSession();
    delete this;
  }

 private:
  void End(const grpc::Status& status) {
    EndSession();
    if (!finished_.exchange(true)) Finish(status);
  }
  void EndSession() {
    if (attached_ && !ended_.exchange(true)) groups_->EndSession(caller_.group, caller_.session);
  }

  GroupManager* const groups_;
  const absl::StatusOr<int64_t> uid_;
  v1::LeaseRequest request_;
  Caller caller_;
  bool attached_ = false;  // touched by the reactor's serialized callbacks only
  std::atomic<bool> ended_{false};
  std::atomic<bool> finished_{false};
};

}  // namespace

absl::StatusOr<int64_t> ShardServiceImpl::CallerUid(const grpc::CallbackServerContext* ctx) const {
  if (access_ == nullptr) return access::kRemoteUid;
  return access_->CallerUid(ctx->peer());
}

absl::StatusOr<Caller> ShardServiceImpl::CallerOf(const grpc::CallbackServerContext* ctx,
                                                  const v1::Caller& c) const {
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return uid.status();
  Caller caller = FromProto(c);
  caller.uid = *uid;
  return caller;
}

absl::Time ShardServiceImpl::WaitDeadline(const grpc::CallbackServerContext* ctx) const {
  const absl::Time now = absl::Now();
  const absl::Time fallback = now + default_wait_;
  absl::Time client = absl::FromChrono(ctx->deadline());
  // Answer a little before the client gives up, so it gets our message naming the missing
  // ranks rather than a bare "Deadline Exceeded".
  // gRPC rounds the timeout it sends, so the margin grows with the wait (up to a second).
  if (client < fallback) {
    client -= std::min(absl::Seconds(1), std::max(absl::Milliseconds(30), (client - now) / 10));
  }
  return std::min(client, fallback);
}

grpc::ServerUnaryReactor* ShardServiceImpl::JoinGroup(grpc::CallbackServerContext* ctx,
                                                      const v1::JoinGroupRequest* request,
                                                      v1::JoinGroupResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "JoinGroup");
  JoinArgs args{request->group(), request->world_size(), request->rank(), request->token(),
                request->coordinator()};
  if (absl::StatusOr<int64_t> uid = CallerUid(ctx); uid.ok()) {
    args.uid = *uid;
  } else {
    return Refuse(reactor, uid.status());
  }
  groups_->Join(args, WaitDeadline(ctx),
                [reactor, response](absl::StatusOr<JoinResult> result) {
                  if (result.ok()) {
                    response->set_session(result->session);
                    for (const auto& m : result->registered_modules) {
                      response->add_registered_modules(m);
                    }
                  }
                  reactor->Finish(ToGrpcStatus(result.status()));
                });
  return reactor;
}

grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse>* ShardServiceImpl::Lease(
    grpc::CallbackServerContext* ctx) {
  return new LeaseReactor(groups_, CallerUid(ctx));
}

grpc::ServerUnaryReactor* ShardServiceImpl::RegisterModule(
    grpc::CallbackServerContext* ctx, const v1::RegisterModuleRequest* request,
    v1::RegisterModuleResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "RegisterModule");
  absl::StatusOr<Manifest> manifest = flatshard::FromProto(request->manifest());
  absl::StatusOr<Policy> policy = flatshard::FromProto(request->policy());
  InitMode init;
  switch (request->init()) {
    case v1::INIT_MODE_ZEROS: init = InitMode::kZeros; break;
    case v1::INIT_MODE_FROM_EVERY_RANK: init = InitMode::kFromEveryRank; break;
    case v1::INIT_MODE_FROM_RANK0: init = InitMode::kFromRank0; break;
    default:
      reactor->Finish(ToGrpcStatus(
          absl::InvalidArgumentError("RegisterModule: init mode is unspecified or unknown")));
      return reactor;
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  groups_->Register(*caller, request->module(), manifest, policy, init,
                    WaitDeadline(ctx),
                    [reactor, response](absl::StatusOr<RegisterResult> result) {
                      if (result.ok()) {
                        *response->mutable_plan() = flatshard::ToProto(result->plan);
                        FillShards(result->shards, response->mutable_shards());
                        response->set_generation(result->generation);
                        if (result->init_summon) {
                          FillSummon(*result->init_summon, response->mutable_init_summon());
                        }
                      }
                      reactor->Finish(ToGrpcStatus(result.status()));
                    });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Summon(grpc::CallbackServerContext* ctx,
                                                   const v1::SummonRequest* request,
                                                   v1::SummonResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Summon");
  SummonOptions options;
  options.recurse = request->options().recurse();
  options.writeback = request->options().writeback();
  options.rank0_only = request->options().rank0_only();
  options.offload_to_cpu = request->options().offload_to_cpu();
  options.with_grads = request->options().with_grads();
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  groups_->Summon(*caller, request->registered_module(), request->path(),
                  options, WaitDeadline(ctx),
                  [reactor, response](absl::StatusOr<SummonResult> result) {
                    if (result.ok()) FillSummon(*result, response);
                    const grpc::Status status = ToGrpcStatus(result.status());
                    // Drop the buffer references before answering: a client that ends and
                    // summons again at once must find the kept buffers free, or the daemon
                    // allocates fresh segments.
                    result = absl::CancelledError();
                    reactor->Finish(status);
                  },
                  EventOf(request->written()));
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::EndSummon(grpc::CallbackServerContext* ctx,
                                                      const v1::EndSummonRequest* request,
                                                      v1::EndSummonResponse*) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "EndSummon");
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  groups_->EndSummon(*caller, request->summon(), WaitDeadline(ctx),
                     [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); },
                     EventOf(request->written()));
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::ReduceScatterGrads(
    grpc::CallbackServerContext* ctx, const v1::ReduceScatterGradsRequest* request,
    v1::ReduceScatterGradsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "ReduceScatterGrads");
  absl::StatusOr<Caller> checked = CallerOf(ctx, request->caller());
  if (!checked.ok()) return Refuse(reactor, checked.status());
  const Caller caller = *std::move(checked);
  if (request->begin()) {
    absl::StatusOr<std::shared_ptr<Buffer>> buffer =
        groups_->BeginReduceScatter(caller, request->registered_module(), request->unit());
    if (buffer.ok()) FillHandle(**buffer, response->mutable_full_grad());
    const grpc::Status status = ToGrpcStatus(buffer.status());
    buffer = absl::CancelledError();  // as in Summon: no reference outlives the answer
    reactor->Finish(status);
    return reactor;
  }
  GradReduce op;
  switch (request->op()) {
    case v1::REDUCE_OP_SUM: op = GradReduce::kSum; break;
    case v1::REDUCE_OP_AVG: op = GradReduce::kAvg; break;
    default:
      reactor->Finish(ToGrpcStatus(absl::InvalidArgumentError(
          "ReduceScatterGrads: op must be REDUCE_OP_SUM or REDUCE_OP_AVG")));
      return reactor;
  }
  groups_->FinishReduceScatter(caller, request->registered_module(), request->unit(), op,
                               request->accumulate(), WaitDeadline(ctx),
                               [this, reactor, response, rank = caller.rank](absl::Status s) {
                                 if (s.ok()) {
                                   const gpu::IpcEventRef ready = groups_->RecordReady(rank);
                                   if (ready.id != 0) FillEvent(ready, response->mutable_ready());
                                 }
                                 reactor->Finish(ToGrpcStatus(s));
                               },
                               EventOf(request->written()));
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::GetShardViews(grpc::CallbackServerContext* ctx,
                                                          const v1::GetShardViewsRequest* request,
                                                          v1::GetShardViewsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "GetShardViews");
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  absl::StatusOr<RegisterResult> result = groups_->GetShards(*caller, request->registered_module());
  if (result.ok()) {
    FillShards(result->shards, response->mutable_shards());
    *response->mutable_plan() = flatshard::ToProto(result->plan);
    response->set_generation(result->generation);
  }
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Commit(grpc::CallbackServerContext* ctx,
                                                   const v1::CommitRequest* request,
                                                   v1::CommitResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Commit");
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  groups_->Commit(*caller, request->registered_module(), WaitDeadline(ctx),
                  [reactor, response](absl::StatusOr<uint64_t> generation) {
                    if (generation.ok()) response->set_generation(*generation);
                    reactor->Finish(ToGrpcStatus(generation.status()));
                  },
                  EventOf(request->written()));
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Ping(grpc::CallbackServerContext* ctx,
                                                 const v1::PingRequest*, v1::PingResponse*) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Ping");
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Leave(grpc::CallbackServerContext* ctx,
                                                  const v1::LeaveRequest* request,
                                                  v1::LeaveResponse*) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Leave");
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  reactor->Finish(ToGrpcStatus(groups_->Leave(*caller)));
  return reactor;
}

}  // namespace flatshard::server
