#pragma once
// ClientCore: the state of a flatshard::client::Client (session, lease, registered modules,
// mapped segments, ordered summons) and the RPCs behind its methods. Client (client.cc) and
// the objects it hands out hold it; those hold it weakly, so that they may outlive it.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "client/cuda_events.h"
#include "client/lease_stream.h"
#include "client/ordered_calls.h"
#include "client/riding_ends.h"
#include "client/segment_cache.h"
#include "client/transition_lane.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.grpc.pb.h"

namespace flatshard::client::internal {

// The Client's state, shared with the objects it hands out (as weak_ptr), so that those
// may outlive it. Thread-safe. Locks: mu_, then LeaseStream::mu_ (never the reverse).
class ClientCore : public std::enable_shared_from_this<ClientCore> {
 public:
  ClientCore(ClientOptions options, std::shared_ptr<grpc::Channel> channel, GpuApis apis)
      : options_(std::move(options)),
        channel_(std::move(channel)),
        stub_(v1::ShardService::NewStub(channel_)),
        lane_(channel_),
        cache_(/*max_entries=*/4096, std::move(apis.opener)),
        events_(std::move(apis.events)) {}
  ~ClientCore();

  static std::unique_ptr<Client> NewClient(std::shared_ptr<ClientCore> core);

  const ClientOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // The current session's caller (Client::SaveCheckpoint and friends), once the summons
  // started before the call were answered (they act on the group too).
  absl::StatusOr<v1::Caller> SessionCaller() const;
  int64_t map_calls() const { return cache_.map_calls(); }
  // Unmaps segments the daemon freed that no view uses any more (SegmentCache::DropUnlinked).
  void DropUnlinked();
  int64_t ipc_open_calls() const { return cache_.ipc_open_calls(); }

  // Ends the session locally: closes the lease (waiting up to LeaseEndWait() for the daemon
  // to end the session), forgets modules. No other RPC.
  void Shutdown();
  // How long closing a lease waits for the daemon to confirm the session ended:
  // min(call_timeout, 5 s).
  absl::Duration LeaseEndWait() const;

  absl::Status Join(std::string group, int world_size, int rank, std::string token,
                    std::string coordinator);

  std::vector<std::string> registered_modules() const;
  std::vector<std::string> lost_modules() const;

  absl::StatusOr<RegisteredModule> Register(std::string module, absl::string_view manifest_json,
                                            absl::string_view policy_json, InitMode init);

  // A Summon's request, checked and with `written` recorded: what StartSummon hands the lane.
  struct PreparedSummon {
    v1::SummonRequest request;
    std::shared_ptr<const ModuleLayout> layout;
    bool writeback = false;
    RidingEnds end_first;  // ended by this Summon's RPC (request.end_first)
  };

  absl::StatusOr<std::unique_ptr<SummonedParams>> Summon(const std::string& module,
                                                         const std::string& path,
                                                         const SummonOptions& options,
                                                         SummonedList end_first = {});

  absl::StatusOr<std::unique_ptr<PendingSummon>> StartSummon(const std::string& module,
                                                             const std::string& path,
                                                             const SummonOptions& options,
                                                             SummonedList end_first = {});

  absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> StartFinish(
      std::unique_ptr<PendingReduceScatter> pending);

  absl::StatusOr<PreparedSummon> PrepareSummon(const std::string& module, const std::string& path,
                                               const SummonOptions& options,
                                               SummonedList end_first);

  // A read-only summon's End on its own (RidingEnds').
  RidingEnds::EndFn PlainEnd();

  // PrepareSummon's request (out->end_first already taken).
  absl::Status FillSummon(const std::string& module, const std::string& path,
                          const SummonOptions& options, PreparedSummon* prepared);

  absl::StatusOr<std::unique_ptr<SummonedParams>> CallSummon(const PreparedSummon& prepared);

  // `device` >= 0: the summon's views are device memory on that GPU.
  // `writeback`: the End is a collective (an agreement); a read-only End is local to the
  // daemon, so it need not wait for started summons.
  absl::Status EndSummon(uint64_t session, const std::string& module, uint64_t summon, int device,
                         bool writeback, std::optional<uint64_t>* generation);

  absl::StatusOr<std::unique_ptr<PendingReduceScatter>> BeginReduceScatter(
      const std::string& module, int32_t unit, ReduceOp op, bool accumulate);

  // `device` >= 0: the full gradient buffer is device memory on that GPU.
  absl::Status FinishReduceScatter(uint64_t session, const std::string& module, int32_t unit,
                                   ReduceOp op, bool accumulate, int device);

  absl::StatusOr<ShardViews> GetShardViews(const std::string& module);

  absl::StatusOr<ShardViews> RegisterState(const std::string& module,
                                           const std::vector<StateSpec>& specs);

  absl::StatusOr<uint64_t> Commit(const std::string& module);

  absl::Status Leave();

  bool joined() const;

  absl::Status lease_status() const;

 private:
  using Stub = v1::ShardService::Stub;

  enum class State { kIdle, kJoining, kJoined, kLeaving };

  template <typename Request, typename Response>
  using UnaryMethod = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&, Response*);

  // One RPC under one deadline. An attempt is retried (with backoff, within the deadline)
  // only when it cannot have taken effect: it failed with UNAVAILABLE, the daemon did not
  // answer it (daemon answers carry kDaemonAnswerKey), and the channel had no connection when
  // it started, so the request never reached a daemon (gRPC fails such calls without sending
  // them). Everything the daemon answers passes through unchanged, UNAVAILABLE included (e.g.
  // "rank 2's session ended ... during a collective": retrying a collective would only add an
  // unrelated error and lose the cause).
  template <typename Request, typename Response>
  absl::Status Call(absl::string_view name, UnaryMethod<Request, Response> method,
                    const Request& request, Response* response, absl::Duration timeout);

  absl::Status JoinAndLease(std::string group, int world_size, int rank, std::string token,
                            std::string coordinator);

  // The caller of the current session. `session` != 0: only if that session is current.
  absl::StatusOr<v1::Caller> CurrentCaller(uint64_t session) const;

  // The GPU of the session's device shards; -1 when it has none (host memory).
  int ShardDevice() const;

  absl::StatusOr<std::shared_ptr<const ModuleLayout>> FindModule(const std::string& module) const;

  static v1::ReduceScatterGradsRequest ReduceScatterRequest(const v1::Caller& caller,
                                                            const std::string& module, int32_t unit,
                                                            ReduceOp op, bool accumulate,
                                                            bool begin);

  absl::StatusOr<std::unique_ptr<SummonedParams>> MakeSummoned(
      std::shared_ptr<const ModuleLayout> layout, const v1::Caller& caller,
      const std::string& module, const v1::SummonResponse& response, bool writable);

  absl::StatusOr<ShardViews> MakeShardViews(
      const ModuleLayout& layout, const v1::Caller& caller,
      const google::protobuf::RepeatedPtrField<v1::UnitShard>& shards,
      const google::protobuf::RepeatedPtrField<v1::StateSpec>& state_specs);

  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<Stub> stub_;  // thread-safe; reused by every call
  TransitionLane lane_;               // Summons (CallSummon); the unary call when it declines
  SegmentCache cache_;
  StreamEvents events_;
  OrderedCalls ordered_;  // StartSummon's RPCs, in issue order

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kIdle;
  v1::Caller caller_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<LeaseStream> lease_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> registered_modules_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> lost_modules_ ABSL_GUARDED_BY(mu_);
  int shard_device_ ABSL_GUARDED_BY(mu_) = -1;  // see ShardDevice()
  absl::flat_hash_map<std::string, std::shared_ptr<const ModuleLayout>> modules_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client::internal
