#pragma once
// ShardService over gRPC's callback API: validate, convert, call GroupManager, finish.
// Collective calls (JoinGroup, RegisterModule, Summon, EndSummon, ReduceScatterGrads) finish
// from the manager's completion callback, so no gRPC thread blocks while ranks gather.
// Each call is validated on the gRPC thread; its GroupManager part runs on RequestWorkers
// (request_workers.h), so that allocations, planning, copies and waits never hold one of the
// few callback threads every service of the daemon shares. Inline: Ping, GetShardViews (a
// lookup), a ReduceScatterGrads begin whose buffers are at hand (the steady state), and
// read-only Summons and Ends of at most 1 MiB of views (the hop would cost more than them).
// Thread-safe.

#include <string>

#include <functional>

#include "absl/time/time.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "server/group_manager.h"
#include "server/service/request_workers.h"

namespace flatshard::server {

namespace access {
class AccessControl;
}

class ShardServiceImpl final : public v1::ShardService::CallbackService {
 public:
  // `default_wait` bounds collective waits whose RPC carries no deadline.
  // `access` (may be null: every caller has uid -1) tells each call's uid. `workers` runs
  // the calls' bodies. Both must outlive the service. `testing_hold_begin` (testing only,
  // DaemonConfig): a FIFO every ReduceScatterGrads begin waits on (HoldForTesting) before it
  // allocates.
  ShardServiceImpl(GroupManager* groups, RequestWorkers* workers, absl::Duration default_wait,
                   const access::AccessControl* access = nullptr,
                   std::string testing_hold_begin = "")
      : groups_(groups),
        workers_(*workers),
        default_wait_(default_wait),
        access_(access),
        testing_hold_begin_(std::move(testing_hold_begin)) {}

  grpc::ServerUnaryReactor* JoinGroup(grpc::CallbackServerContext* ctx,
                                      const v1::JoinGroupRequest* request,
                                      v1::JoinGroupResponse* response) override;
  grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse>* Lease(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* RegisterModule(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterModuleRequest* request,
                                           v1::RegisterModuleResponse* response) override;
  grpc::ServerUnaryReactor* Summon(grpc::CallbackServerContext* ctx,
                                   const v1::SummonRequest* request,
                                   v1::SummonResponse* response) override;
  grpc::ServerUnaryReactor* EndSummon(grpc::CallbackServerContext* ctx,
                                      const v1::EndSummonRequest* request,
                                      v1::EndSummonResponse* response) override;
  grpc::ServerUnaryReactor* ReduceScatterGrads(grpc::CallbackServerContext* ctx,
                                               const v1::ReduceScatterGradsRequest* request,
                                               v1::ReduceScatterGradsResponse* response) override;
  grpc::ServerUnaryReactor* GetShardViews(grpc::CallbackServerContext* ctx,
                                          const v1::GetShardViewsRequest* request,
                                          v1::GetShardViewsResponse* response) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const v1::CommitRequest* request,
                                   v1::CommitResponse* response) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx, const v1::PingRequest* request,
                                 v1::PingResponse* response) override;
  grpc::ServerUnaryReactor* AllReduceValues(grpc::CallbackServerContext* ctx,
                                            const v1::AllReduceValuesRequest* request,
                                            v1::AllReduceValuesResponse* response) override;
  grpc::ServerUnaryReactor* BroadcastBytes(grpc::CallbackServerContext* ctx,
                                           const v1::BroadcastBytesRequest* request,
                                           v1::BroadcastBytesResponse* response) override;
  grpc::ServerUnaryReactor* RegisterState(grpc::CallbackServerContext* ctx,
                                          const v1::RegisterStateRequest* request,
                                          v1::RegisterStateResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;

  // Summon's body, shared by the unary call and the transition lane
  // (server/service/transition_lane_service.h): checks `request`, runs it, and calls
  // `finish` once with the call's status (`response` filled when OK), on whichever thread
  // ends it. `request` and `response` must live until `finish` ran. `client_deadline`: when
  // the client gives up (the collective's wait ends a little before; InfiniteFuture: the
  // default wait).
  void RunSummon(const grpc::CallbackServerContext* ctx, const v1::SummonRequest* request,
                 v1::SummonResponse* response, absl::Time client_deadline,
                 std::function<void(grpc::Status)> finish);
  // A read-only Summon answered OK whose answer never reached its caller (the transition
  // lane's reply could not be written): ends it, as its caller cannot. Writeback summons
  // (whose End is a collective) are left to the session's end.
  void EndUnanswered(const grpc::CallbackServerContext* ctx, const v1::SummonRequest& request,
                     const v1::SummonResponse& response);

 private:
  void EndUnanswered(const Caller& caller, uint64_t summon);
  absl::Time WaitDeadline(const grpc::CallbackServerContext* ctx) const;
  absl::Time WaitDeadline(absl::Time client_deadline) const;
  // The calling process's uid (access::AccessControl), or why it may not call.
  absl::StatusOr<int64_t> CallerUid(const grpc::CallbackServerContext* ctx) const;
  // `c` with the caller's uid.
  absl::StatusOr<Caller> CallerOf(const grpc::CallbackServerContext* ctx,
                                  const v1::Caller& c) const;
  // Summon's end_first: ends request->end_first(next..) one after another (as EndSummon),
  // then calls `then` with OK, or with the first End's error naming its summon.
  // `request` lives until the call's reactor finishes, which `then` does.
  void EndFirst(const Caller& caller, const v1::SummonRequest* request, int next,
                absl::Time deadline, std::function<void(absl::Status)> then);
  // Whether a Summon (with its end_first Ends) is small enough for the RPC thread
  // (kInlineBytes, no writeback); looked up under the group's lock, nothing changed.
  bool SmallSummon(const Caller& caller, const v1::SummonRequest& request,
                   const SummonOptions& options) const;
  // The view bytes of the End of the caller's open `summon`; more than kInlineBytes where it
  // writes back or is unknown (the End itself then answers on a worker).
  int64_t SmallEndBytes(const Caller& caller, uint64_t summon) const;

  // Testing only: writes a line to the FIFO `fifo`.held (the test counts the calls held),
  // then opens the FIFO `fifo` for reading, which blocks until the test opens it for writing.
  static void HoldForTesting(const std::string& fifo);

  GroupManager* const groups_;
  RequestWorkers& workers_;
  const absl::Duration default_wait_;
  const access::AccessControl* const access_;
  const std::string testing_hold_begin_;
};

}  // namespace flatshard::server
