#include "server/service/transition_lane_service.h"

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/metrics/metered_reactor.h"
#include "server/metrics/registry.h"
#include "server/service/shard_service_impl.h"

namespace flatshard::server {
namespace {

grpc::Status ShuttingDown() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "flatshardd is shutting down");
}

// Requests answered on lanes (also counted in flatshard_rpcs_total{method="Summon"}): how a
// stranger sees that the client library's transitions take the lane.
metrics::CounterFamily& LaneRequests() {
  static metrics::CounterFamily& family = metrics::DefaultRegistry().AddCounter(
      "flatshard_transition_lane_requests_total",
      "Summons answered on a transition lane (a stream per client) rather than as unary calls");
  return family;
}

}  // namespace

// One client's lane. States: reading (waiting for the next request), busy (a request runs),
// writing (its reply is on its way), finished. Requests and replies alternate, so at most
// one operation is outstanding; Finish runs exactly once, from whichever of OnReadDone,
// OnWriteDone or End sees the lane end first.
class LaneReactor final : public grpc::ServerBidiReactor<v1::LaneRequest, v1::LaneReply> {
 public:
  LaneReactor(TransitionLaneService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    if (!service_->Add(this)) {
      absl::MutexLock lock(&mu_);
      FinishLocked(ShuttingDown());
      return;
    }
    registered_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      if (!ok || ending_) {
        // The client closed its side (or the daemon is shutting down): nothing in flight.
        FinishLocked(ending_ ? ShuttingDown() : grpc::Status::OK);
        return;
      }
      busy_ = true;
    }
    reply_.Clear();
    start_ = absl::Now();
    const absl::Time client_deadline = request_.timeout_ms() == 0
                                           ? absl::InfiniteFuture()
                                           : start_ + absl::Milliseconds(request_.timeout_ms());
    service_->summons_->RunSummon(ctx_, &request_.summon(), reply_.mutable_summon(),
                                  client_deadline,
                                  [this](grpc::Status status) { Answer(std::move(status)); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok && reply_.code() == 0) {
      // The client cancelled the lane before this answer reached it (its deadline passed).
      service_->summons_->EndUnanswered(ctx_, request_.summon(), reply_.summon());
    }
    absl::MutexLock lock(&mu_);
    busy_ = false;
    if (finished_) return;
    if (!ok || ending_) {
      FinishLocked(ok ? ShuttingDown() : grpc::Status::CANCELLED);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    if (registered_) service_->Remove(this);
    delete this;
  }

  // The daemon is shutting down: an idle lane ends now, a busy one after its reply.
  void End() {
    absl::MutexLock lock(&mu_);
    ending_ = true;
    if (finished_ || busy_) return;
    FinishLocked(ShuttingDown());
  }

 private:
  // The request's end, on whichever thread ran it: its reply goes out (the status in the
  // message: the stream itself stays OK).
  void Answer(grpc::Status status) {
    metrics::RecordRpc("Summon", static_cast<absl::StatusCode>(status.error_code()),
                       absl::Now() - start_);
    LaneRequests().WithLabels({}).Increment();
    reply_.set_code(static_cast<int32_t>(status.error_code()));
    if (status.ok()) {
      reply_.set_message("");
    } else {
      reply_.clear_summon();
      reply_.set_message(status.error_message());
    }
    StartWrite(&reply_);
  }

  // Finish exactly once (every caller checked finished_ first).
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    Finish(std::move(status));
  }

  TransitionLaneService* const service_;
  grpc::CallbackServerContext* const ctx_;
  bool registered_ = false;
  v1::LaneRequest request_;
  v1::LaneReply reply_;
  absl::Time start_;
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;      // a request runs or its reply is being written
  bool ending_ ABSL_GUARDED_BY(mu_) = false;    // the daemon is shutting down
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called
};

TransitionLaneService::TransitionLaneService(ShardServiceImpl* summons) : summons_(summons) {
  LaneRequests();  // rendered (as 0) from the start
}

grpc::ServerBidiReactor<v1::LaneRequest, v1::LaneReply>* TransitionLaneService::Transitions(
    grpc::CallbackServerContext* ctx) {
  return new LaneReactor(this, ctx);
}

bool TransitionLaneService::Add(LaneReactor* lane) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return false;
  lanes_.insert(lane);
  return true;
}

void TransitionLaneService::Remove(LaneReactor* lane) {
  absl::MutexLock lock(&mu_);
  lanes_.erase(lane);
}

void TransitionLaneService::Shutdown() {
  // Under mu_ throughout: a lane removes itself (OnDone, then delete) only under mu_, so none
  // is deleted while End runs on it. End takes only the lane's own lock, and Finish does not
  // call back into the reactor synchronously.
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  for (LaneReactor* lane : lanes_) lane->End();
}

}  // namespace flatshard::server
