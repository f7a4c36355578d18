#include "server/service/shard_service_impl.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <tuple>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/proto_convert.h"
#include "common/status_macros.h"
#include "server/access/access_control.h"
#include "server/metrics/metered_reactor.h"

namespace flatshard::server {
namespace {

// README "Limits": the names a request carries, refused (INVALID_ARGUMENT naming the field and
// the limit) before anything looks them up, logs or quotes them.
absl::Status CheckCallerBounds(absl::string_view method, const v1::Caller& c) {
  FS_RETURN_IF_ERROR(CheckLength(method, "caller.group", c.group(), kMaxGroupBytes));
  return CheckLength(method, "caller.token", c.token(), kMaxTokenBytes);
}

// Answers a call its caller may not make (access control) and returns the reactor.
template <typename Reactor>
Reactor* Refuse(Reactor* reactor, const absl::Status& status) {
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Summons and Ends of at most this many view bytes (and no writeback) run on the RPC thread:
// allocating, gathering and copying that much takes about 100 us, where the hop to
// RequestWorkers added 30-40 us p50 to each call (daemon benchmark, loaded 2-core host);
// larger ones may take seconds.
constexpr int64_t kInlineBytes = int64_t{1} << 20;

// Where a buffer's bytes are, for the client (its wire form is proto_convert's).
MemoryHandle HandleOf(const Buffer& b) {
  MemoryHandle h;
  h.segment = b.segment_name();
  h.segment_bytes = static_cast<uint64_t>(b.segment_bytes());
  h.offset = static_cast<uint64_t>(b.offset());
  h.bytes = static_cast<uint64_t>(b.bytes());
  if (b.on_device()) {
    h.cuda = true;
    h.cuda_ipc_handle = b.ipc_handle();
    h.device_uuid = b.device_uuid();
    h.device = b.placement().device;
  }
  return h;
}

void FillHandle(const Buffer& b, v1::MemoryHandle* h) { *h = flatshard::ToProto(HandleOf(b)); }

void FillEvent(const gpu::IpcEventRef& e, v1::CudaEvent* out) { *out = flatshard::ToProto(e); }

gpu::IpcEventRef EventOf(const v1::CudaEvent& e) { return flatshard::FromProto(e); }

void FillShards(const std::vector<UnitShard>& shards,
                google::protobuf::RepeatedPtrField<v1::UnitShard>* out) {
  for (const UnitShard& s : shards) {
    v1::UnitShard* u = out->Add();
    u->set_unit(s.unit);
    FillHandle(*s.shard, u->mutable_shard());
    if (s.grad) FillHandle(*s.grad, u->mutable_grad());
    for (const std::shared_ptr<Buffer>& b : s.state) FillHandle(*b, u->add_state());
  }
}

void FillStateSpecs(const std::vector<StateSpec>& specs,
                    google::protobuf::RepeatedPtrField<v1::StateSpec>* out) {
  for (const StateSpec& spec : specs) *out->Add() = flatshard::ToProto(spec);
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
  LeaseReactor(GroupManager* groups, RequestWorkers* workers, absl::StatusOr<int64_t> uid)
      : groups_(groups), workers_(workers), uid_(std::move(uid)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(grpc::Status::OK);
      return;
    }
    if (!attached_) {
      caller_ = flatshard::FromProto(request_.caller());
      caller_.uid = uid_.ok() ? *uid_ : access::kRemoteUid;
      // Only the session's first lease counts: a second stream naming the same caller is
      // refused (AttachLease), so that its end cannot end the session.
      absl::Status s = CheckCallerBounds("Lease", request_.caller());
      if (s.ok()) s = uid_.ok() ? groups_->AttachLease(caller_) : uid_.status();
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
  // The stream finishes only once the session ended: a client that closed its lease waits
  // for that answer (~Client), then may join the rank again at once (client.h).
  void End(const grpc::Status& status) {
    if (finished_.exchange(true)) {
      EndSession();
      return;
    }
    if (!EndSession([this, status] { Finish(status); })) Finish(status);
  }
  // On the rank's strand: after the calls it made before its lease ended, and off the gRPC
  // thread (the rank's summons' buffers may be unmapped). Runs `then` after it; false (and
  // `then` not run) when there is no session to end, or it is ended already.
  bool EndSession(absl::AnyInvocable<void()> then = nullptr) {
    if (!attached_ || ended_.exchange(true)) return false;
    workers_->Post(caller_, [groups = groups_, group = caller_.group, session = caller_.session,
                             then = std::move(then)]() mutable {
      groups->EndSession(group, session);
      if (then) then();
    });
    return true;
  }

  GroupManager* const groups_;
  RequestWorkers* const workers_;
  const absl::StatusOr<int64_t> uid_;
  v1::LeaseRequest request_;
  Caller caller_;
  bool attached_ = false;  // touched by the reactor's serialized callbacks only
  std::atomic<bool> ended_{false};
  std::atomic<bool> finished_{false};
};

}  // namespace

void ShardServiceImpl::HoldForTesting(const std::string& fifo) {
  // Each open blocks until the test opened the other end: no polling on either side.
  if (const int held = ::open((fifo + ".held").c_str(), O_WRONLY); held >= 0) {
    const ssize_t wrote = ::write(held, "held\n", 5);
    (void)wrote;
    ::close(held);
  }
  if (const int fd = ::open(fifo.c_str(), O_RDONLY); fd >= 0) ::close(fd);
}

absl::StatusOr<int64_t> ShardServiceImpl::CallerUid(const grpc::CallbackServerContext* ctx) const {
  if (access_ == nullptr) return access::kRemoteUid;
  return access_->CallerUid(ctx->peer());
}

absl::StatusOr<Caller> ShardServiceImpl::CallerOf(const grpc::CallbackServerContext* ctx,
                                                  const v1::Caller& c) const {
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return uid.status();
  Caller caller = flatshard::FromProto(c);
  caller.uid = *uid;
  return caller;
}

absl::Time ShardServiceImpl::WaitDeadline(const grpc::CallbackServerContext* ctx) const {
  return WaitDeadline(absl::FromChrono(ctx->deadline()));
}

absl::Time ShardServiceImpl::WaitDeadline(absl::Time client) const {
  const absl::Time now = absl::Now();
  const absl::Time fallback = now + default_wait_;
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
  for (const auto& [field, value, max] :
       {std::tuple<const char*, const std::string&, size_t>{"group", request->group(),
                                                            kMaxGroupBytes},
        {"token", request->token(), kMaxTokenBytes},
        {"coordinator", request->coordinator(), kMaxAddressBytes}}) {
    if (absl::Status s = CheckLength("JoinGroup", field, value, max); !s.ok()) {
      return Refuse(reactor, s);
    }
  }
  JoinArgs args;
  args.group = request->group();
  args.world_size = request->world_size();
  args.rank = request->rank();
  args.token = request->token();
  args.coordinator = request->coordinator();
  // A caller that dies (or gives up) while its join waits for the other ranks cancels the
  // call; the join is then withdrawn instead of completing for nobody. The context lives
  // until the call is finished, which happens only after the join stopped pending.
  args.caller_gone = [ctx] { return ctx->IsCancelled(); };
  if (absl::StatusOr<int64_t> uid = CallerUid(ctx); uid.ok()) {
    args.uid = *uid;
  } else {
    return Refuse(reactor, uid.status());
  }
  Caller strand;
  strand.group = args.group;
  strand.rank = args.rank;
  workers_.Post(
      strand, [this, reactor, response, args = std::move(args), deadline = WaitDeadline(ctx)] {
        groups_->Join(args, deadline, [reactor, response](absl::StatusOr<JoinResult> result) {
          if (result.ok()) {
            response->set_session(result->session);
            for (const auto& m : result->registered_modules) {
              response->add_registered_modules(m);
            }
            for (const auto& m : result->lost_modules) response->add_lost_modules(m);
          }
          reactor->Finish(ToGrpcStatus(result.status()));
        });
      });
  return reactor;
}

grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse>* ShardServiceImpl::Lease(
    grpc::CallbackServerContext* ctx) {
  return new LeaseReactor(groups_, &workers_, CallerUid(ctx));
}

grpc::ServerUnaryReactor* ShardServiceImpl::RegisterModule(grpc::CallbackServerContext* ctx,
                                                           const v1::RegisterModuleRequest* request,
                                                           v1::RegisterModuleResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "RegisterModule");
  if (absl::Status s = CheckCallerBounds("RegisterModule", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  if (absl::Status s =
          CheckLength("RegisterModule", "module", request->module(), kMaxModulePathBytes);
      !s.ok()) {
    return Refuse(reactor, s);
  }
  // The manifest's size is bounded by its module count (FromProto, before converting); the
  // policy's lists by its encoded size.
  if (const size_t bytes = request->policy().ByteSizeLong(); bytes > kMaxPolicyJsonBytes) {
    return Refuse(reactor, absl::InvalidArgumentError(absl::StrCat("RegisterModule: policy has ",
                                                                   bytes, " bytes, the limit is ",
                                                                   kMaxPolicyJsonBytes)));
  }
  absl::StatusOr<Manifest> manifest = flatshard::FromProto(request->manifest());
  absl::StatusOr<Policy> policy = flatshard::FromProto(request->policy());
  absl::StatusOr<InitMode> init = flatshard::FromProto(request->init());
  if (!init.ok()) {
    return Refuse(reactor, absl::InvalidArgumentError(
                               absl::StrCat("RegisterModule: ", init.status().message())));
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  // Posted: planning a large model and allocating the rank's shards take long.
  workers_.Post(
      *caller, [this, reactor, request, response, caller = *caller, manifest = std::move(manifest),
                policy = std::move(policy), init = *init, deadline = WaitDeadline(ctx)] {
        groups_->Register(caller, request->module(), manifest, policy, init, deadline,
                          [reactor, response](absl::StatusOr<RegisterResult> result) {
                            if (result.ok()) {
                              *response->mutable_plan() = flatshard::ToProto(result->plan);
                              FillShards(result->shards, response->mutable_shards());
                              response->set_generation(result->generation);
                              FillStateSpecs(result->state_specs, response->mutable_state_specs());
                              if (result->init_summon) {
                                FillSummon(*result->init_summon, response->mutable_init_summon());
                              }
                            }
                            reactor->Finish(ToGrpcStatus(result.status()));
                          });
      });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Summon(grpc::CallbackServerContext* ctx,
                                                   const v1::SummonRequest* request,
                                                   v1::SummonResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Summon");
  RunSummon(ctx, request, response, absl::FromChrono(ctx->deadline()),
            [reactor](grpc::Status status) { reactor->Finish(std::move(status)); });
  return reactor;
}

void ShardServiceImpl::RunSummon(const grpc::CallbackServerContext* ctx,
                                 const v1::SummonRequest* request, v1::SummonResponse* response,
                                 absl::Time client_deadline,
                                 std::function<void(grpc::Status)> finish) {
  for (const auto& [field, value] : {std::pair<const char*, const std::string&>{
                                         "registered_module", request->registered_module()},
                                     {"path", request->path()}}) {
    if (absl::Status s = CheckLength("Summon", field, value, kMaxModulePathBytes); !s.ok()) {
      finish(ToGrpcStatus(s));
      return;
    }
  }
  if (absl::Status s = CheckCallerBounds("Summon", request->caller()); !s.ok()) {
    finish(ToGrpcStatus(s));
    return;
  }
  if (request->end_first_size() > kMaxEndFirst) {
    finish(ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("Summon: end_first names ", request->end_first_size(),
                     " summons, the limit is ", kMaxEndFirst))));
    return;
  }
  const SummonOptions options = flatshard::FromProto(request->options());
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) {
    finish(ToGrpcStatus(caller.status()));
    return;
  }
  const absl::Time deadline = WaitDeadline(client_deadline);
  auto summon = [this, ctx, finish, request, response, caller = *caller, options,
                 deadline](absl::Status ended) {
    if (!ended.ok()) {
      finish(ToGrpcStatus(ended));
      return;
    }
    groups_->Summon(
        caller, request->registered_module(), request->path(), options, deadline,
        [this, ctx, caller, writeback = options.writeback, finish,
         response](absl::StatusOr<SummonResult> result) {
          if (result.ok() && !writeback && ctx->IsCancelled()) {
            // Its caller gave up first (its deadline, a frozen daemon, a dead client).
            const uint64_t id = result->summon;
            result = absl::CancelledError();  // the views' buffers go first
            EndUnanswered(caller, id);
            finish(grpc::Status(grpc::StatusCode::CANCELLED,
                                "the caller gave up before the answer; the summon was ended"));
            return;
          }
          if (result.ok()) FillSummon(*result, response);
          const grpc::Status status = ToGrpcStatus(result.status());
          // Drop the buffer references before answering: a client that ends and
          // summons again at once must find the kept buffers free, or the daemon
          // allocates fresh segments.
          result = absl::CancelledError();
          finish(status);
        },
        EventOf(request->written()));
  };
  // Posted unless small: a summon allocates its views, gathers (the last local rank copies
  // every rank's shards) and may wait for the rank's last writeback copy.
  auto body = [this, request, caller = *caller, deadline, summon = std::move(summon)]() mutable {
    EndFirst(caller, request, 0, deadline, std::move(summon));
  };
  if (SmallSummon(*caller, *request, options)) {
    body();
  } else {
    workers_.Post(*caller, std::move(body));
  }
}

void ShardServiceImpl::EndUnanswered(const Caller& caller, uint64_t summon) {
  // No one will end a summon whose id never reached its caller, and it would refuse the
  // units' next summon on this session. A read-only End is local to the daemon.
  FS_LOG(WARNING) << "group=" << caller.group << " rank=" << caller.rank << " summon " << summon
                  << " ended: its caller gave up before the answer";
  groups_->EndSummon(caller, summon, WaitDeadline(absl::InfiniteFuture()),
                     [caller, summon](absl::Status s) {
                       if (!s.ok() && !absl::IsNotFound(s)) {
                         FS_LOG(WARNING) << "group=" << caller.group << " rank=" << caller.rank
                                         << " summon " << summon << " (answer lost): " << s;
                       }
                     });
}

void ShardServiceImpl::EndUnanswered(const grpc::CallbackServerContext* ctx,
                                     const v1::SummonRequest& request,
                                     const v1::SummonResponse& response) {
  if (request.options().writeback() || response.summon() == 0) return;
  absl::StatusOr<Caller> caller = CallerOf(ctx, request.caller());
  if (caller.ok()) EndUnanswered(*caller, response.summon());
}

bool ShardServiceImpl::SmallSummon(const Caller& caller, const v1::SummonRequest& request,
                                   const SummonOptions& options) const {
  if (options.writeback) return false;  // it may wait for the rank's last writeback copy
  absl::StatusOr<int64_t> bytes =
      groups_->SummonBytes(caller, request.registered_module(), request.path(), options);
  if (!bytes.ok()) return false;  // answered from a worker
  int64_t total = *bytes;
  for (uint64_t summon : request.end_first()) {
    total += SmallEndBytes(caller, summon);
  }
  return total <= kInlineBytes;
}

int64_t ShardServiceImpl::SmallEndBytes(const Caller& caller, uint64_t summon) const {
  bool writeback = true;
  absl::StatusOr<int64_t> bytes = groups_->OpenSummonBytes(caller, summon, &writeback);
  return bytes.ok() && !writeback ? *bytes : kInlineBytes + 1;
}

void ShardServiceImpl::EndFirst(const Caller& caller, const v1::SummonRequest* request, int next,
                                absl::Time deadline, std::function<void(absl::Status)> then) {
  if (next == request->end_first_size()) {
    then(absl::OkStatus());
    return;
  }
  const uint64_t summon = request->end_first(next);
  groups_->EndSummon(
      caller, summon, deadline,
      [this, caller, request, next, deadline, summon, then = std::move(then)](absl::Status s) {
        if (!s.ok()) {
          then(absl::Status(s.code(), absl::StrCat("Summon: ending summon ", summon,
                                                   " first (end_first): ", s.message())));
          return;
        }
        EndFirst(caller, request, next + 1, deadline, std::move(then));
      },
      EventOf(request->written()));
}

grpc::ServerUnaryReactor* ShardServiceImpl::EndSummon(grpc::CallbackServerContext* ctx,
                                                      const v1::EndSummonRequest* request,
                                                      v1::EndSummonResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "EndSummon");
  if (absl::Status s = CheckCallerBounds("EndSummon", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  auto body = [this, reactor, request, response, caller = *caller, deadline = WaitDeadline(ctx)] {
    // The answer carries the generation the rank's shards hold once the End is done (a
    // writeback End commits), so that the trainer needs no second call to learn it.
    absl::StatusOr<std::string> module = groups_->ModuleOfSummon(caller, request->summon());
    groups_->EndSummon(
        caller, request->summon(), deadline,
        [this, reactor, response, caller, module](absl::Status s) {
          if (s.ok() && module.ok()) {
            if (absl::StatusOr<uint64_t> g = groups_->Generation(caller, *module); g.ok()) {
              response->set_generation(*g);
            }
          }
          reactor->Finish(ToGrpcStatus(s));
        },
        EventOf(request->written()));
  };
  // Posted unless small and read-only: a writeback End copies the views into the shards.
  if (SmallEndBytes(*caller, request->summon()) <= kInlineBytes) {
    body();
  } else {
    workers_.Post(*caller, std::move(body));
  }
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::ReduceScatterGrads(
    grpc::CallbackServerContext* ctx, const v1::ReduceScatterGradsRequest* request,
    v1::ReduceScatterGradsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "ReduceScatterGrads");
  if (absl::Status s = CheckCallerBounds("ReduceScatterGrads", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  if (absl::Status s = CheckLength("ReduceScatterGrads", "registered_module",
                                   request->registered_module(), kMaxModulePathBytes);
      !s.ok()) {
    return Refuse(reactor, s);
  }
  // The op acts in phase 2, which must name SUM or AVG; phase 1 may leave it unspecified
  // (older clients do), but a value outside the enum is refused in either phase, before a
  // buffer is handed out.
  absl::StatusOr<ReduceOp> parsed = flatshard::FromProto(request->op());
  if (!parsed.ok() && (!request->begin() || !v1::ReduceOp_IsValid(request->op()))) {
    return Refuse(reactor, absl::InvalidArgumentError(
                               absl::StrCat("ReduceScatterGrads: ", parsed.status().message())));
  }
  const ReduceOp op = parsed.ok() ? *parsed : ReduceOp::kSum;
  absl::StatusOr<Caller> checked = CallerOf(ctx, request->caller());
  if (!checked.ok()) return Refuse(reactor, checked.status());
  const Caller caller = *std::move(checked);
  if (request->begin()) {
    auto answer = [reactor, response](absl::StatusOr<std::shared_ptr<Buffer>> buffer) {
      if (buffer.ok()) FillHandle(**buffer, response->mutable_full_grad());
      const grpc::Status status = ToGrpcStatus(buffer.status());
      buffer = absl::CancelledError();  // as in Summon: no reference outlives the answer
      reactor->Finish(status);
    };
    // Inline in the steady state (the unit's buffers are at hand: a lookup); posted where the
    // first begin of a unit allocates them (a GiB: seconds).
    absl::StatusOr<std::shared_ptr<Buffer>> at_hand = groups_->BeginReduceScatter(
        caller, request->registered_module(), request->unit(), /*may_allocate=*/false);
    if (!at_hand.ok() || *at_hand != nullptr) {
      answer(std::move(at_hand));
      return reactor;
    }
    workers_.Post(caller, [this, request, caller, answer = std::move(answer)]() mutable {
      if (!testing_hold_begin_.empty()) HoldForTesting(testing_hold_begin_);
      answer(groups_->BeginReduceScatter(caller, request->registered_module(), request->unit()));
    });
    return reactor;
  }
  // Posted: finishing takes (or allocates) the reduced shard's scratch buffer.
  workers_.Post(caller, [this, reactor, request, response, caller, op,
                         deadline = WaitDeadline(ctx)] {
    groups_->FinishReduceScatter(
        caller, request->registered_module(), request->unit(), op, request->accumulate(), deadline,
        [this, reactor, response, rank = caller.rank](absl::Status s) {
          if (s.ok()) {
            const gpu::IpcEventRef ready = groups_->RecordReady(rank);
            if (ready.id != 0) FillEvent(ready, response->mutable_ready());
          }
          reactor->Finish(ToGrpcStatus(s));
        },
        EventOf(request->written()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::GetShardViews(grpc::CallbackServerContext* ctx,
                                                          const v1::GetShardViewsRequest* request,
                                                          v1::GetShardViewsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "GetShardViews");
  if (absl::Status s = CheckCallerBounds("GetShardViews", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  if (absl::Status s = CheckLength("GetShardViews", "registered_module",
                                   request->registered_module(), kMaxModulePathBytes);
      !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  // Inline: a lookup under the group's lock, which no one holds across slow work.
  absl::StatusOr<RegisterResult> result = groups_->GetShards(*caller, request->registered_module());
  if (result.ok()) {
    FillShards(result->shards, response->mutable_shards());
    *response->mutable_plan() = flatshard::ToProto(result->plan);
    response->set_generation(result->generation);
    FillStateSpecs(result->state_specs, response->mutable_state_specs());
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
  workers_.Post(*caller,
                [this, reactor, request, response, caller = *caller, deadline = WaitDeadline(ctx)] {
                  groups_->Commit(
                      caller, request->registered_module(), deadline,
                      [reactor, response](absl::StatusOr<uint64_t> generation) {
                        if (generation.ok()) response->set_generation(*generation);
                        reactor->Finish(ToGrpcStatus(generation.status()));
                      },
                      EventOf(request->written()));
                });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::AllReduceValues(
    grpc::CallbackServerContext* ctx, const v1::AllReduceValuesRequest* request,
    v1::AllReduceValuesResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "AllReduceValues");
  if (absl::Status s = CheckCallerBounds("AllReduceValues", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  // Unknown enums take part with a value GroupCollectives refuses, naming this rank on every
  // rank (a refusal here would leave the other ranks waiting for it).
  const ValuesType type = request->dtype() == v1::DTYPE_FLOAT64   ? ValuesType::kFloat64
                          : request->dtype() == v1::DTYPE_FLOAT32 ? ValuesType::kFloat32
                                                                  : ValuesType{0};
  const ValuesOp op = request->op() == v1::VALUES_REDUCE_OP_SUM   ? ValuesOp::kSum
                      : request->op() == v1::VALUES_REDUCE_OP_MAX ? ValuesOp::kMax
                      : request->op() == v1::VALUES_REDUCE_OP_MIN ? ValuesOp::kMin
                                                                  : ValuesOp{0};
  // Posted: the group's collectives of one rank are matched in the order it calls them.
  workers_.Post(*caller, [this, reactor, request, response, caller = *caller, type, op,
                          deadline = WaitDeadline(ctx)] {
    groups_->AllReduceValues(caller, type, op, request->values(), deadline,
                             [reactor, response](absl::StatusOr<std::string> values) {
                               if (values.ok()) *response->mutable_values() = std::move(*values);
                               reactor->Finish(ToGrpcStatus(values.status()));
                             });
  });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::BroadcastBytes(grpc::CallbackServerContext* ctx,
                                                           const v1::BroadcastBytesRequest* request,
                                                           v1::BroadcastBytesResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "BroadcastBytes");
  if (absl::Status s = CheckCallerBounds("BroadcastBytes", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  workers_.Post(*caller,
                [this, reactor, request, response, caller = *caller, deadline = WaitDeadline(ctx)] {
                  groups_->BroadcastBytes(caller, request->root(), request->data(), deadline,
                                          [reactor, response](absl::StatusOr<std::string> data) {
                                            if (data.ok())
                                              *response->mutable_data() = std::move(*data);
                                            reactor->Finish(ToGrpcStatus(data.status()));
                                          });
                });
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
  if (absl::Status s = CheckCallerBounds("Leave", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  // Posted: after the rank's earlier calls; its buffers may be unmapped.
  workers_.Post(*caller, [this, reactor, caller = *caller] {
    reactor->Finish(ToGrpcStatus(groups_->Leave(caller)));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::RegisterState(grpc::CallbackServerContext* ctx,
                                                          const v1::RegisterStateRequest* request,
                                                          v1::RegisterStateResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "RegisterState");
  if (absl::Status s = CheckCallerBounds("RegisterState", request->caller()); !s.ok()) {
    return Refuse(reactor, s);
  }
  if (absl::Status s = CheckLength("RegisterState", "registered_module",
                                   request->registered_module(), kMaxModulePathBytes);
      !s.ok()) {
    return Refuse(reactor, s);
  }
  absl::StatusOr<Caller> caller = CallerOf(ctx, request->caller());
  if (!caller.ok()) return Refuse(reactor, caller.status());
  absl::StatusOr<std::vector<StateSpec>> specs = flatshard::FromProto(request->specs());
  if (!specs.ok()) {
    return Refuse(reactor, absl::InvalidArgumentError(
                               absl::StrCat("RegisterState: ", specs.status().message())));
  }
  // Posted: allocates the rank's optimizer state (shard-sized buffers).
  workers_.Post(*caller,
                [this, reactor, request, response, caller = *caller, specs = *std::move(specs)] {
                  absl::StatusOr<RegisterStateResult> result =
                      groups_->RegisterState(caller, request->registered_module(), specs);
                  if (result.ok()) {
                    FillShards(result->shards, response->mutable_shards());
                    FillStateSpecs(result->specs, response->mutable_state_specs());
                    response->set_generation(result->generation);
                    response->set_created(result->created);
                  }
                  reactor->Finish(ToGrpcStatus(result.status()));
                });
  return reactor;
}

}  // namespace flatshard::server
