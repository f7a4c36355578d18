#include "client/transition_lane.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace flatshard::client::internal {
namespace {

// How often the watchdog looks at a request in flight: a deadline is kept to within this.
constexpr absl::Duration kWatchPeriod = absl::Milliseconds(50);

}  // namespace

TransitionLane::TransitionLane(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(v1::TransitionLane::NewStub(channel_)) {
  const char* off = std::getenv("FLATSHARD_NO_TRANSITION_LANE");
  absl::MutexLock lock(&mu_);
  unsupported_ = off != nullptr && off[0] != '\0' && std::string(off) != "0";
}

TransitionLane::~TransitionLane() {
  {
    absl::MutexLock lock(&watch_mu_);
    stop_ = true;
    // A request still in flight on another thread returns now rather than wait for a
    // watchdog that is going away.
    if (watched_ != nullptr) watched_->TryCancel();
  }
  if (watchdog_.joinable()) watchdog_.join();
  absl::MutexLock lock(&mu_);
  if (stream_ != nullptr) CloseStream(/*cancel=*/true);
}

grpc::Status TransitionLane::CloseStream(bool cancel) {
  // Cancelled first where the stream may still be open: Finish would otherwise wait for a
  // daemon that may never answer. A stream whose Write or Read failed has ended: its Finish
  // returns at once with the daemon's status (e.g. UNIMPLEMENTED from an older daemon).
  if (cancel) context_->TryCancel();
  grpc::Status status = stream_->Finish();
  stream_.reset();
  context_.reset();
  return status;
}

void TransitionLane::Watch() {
  absl::MutexLock lock(&watch_mu_);
  while (!stop_) {
    if (watched_ != nullptr && absl::Now() >= watch_deadline_) {
      watched_->TryCancel();
      watched_ = nullptr;
      timed_out_ = true;
    }
    watch_mu_.AwaitWithTimeout(absl::Condition(&stop_), kWatchPeriod);
  }
}

std::optional<absl::Status> TransitionLane::Summon(const v1::SummonRequest& request,
                                                   v1::SummonResponse* response,
                                                   absl::Duration timeout) {
  if (!mu_.TryLock()) return std::nullopt;  // another thread's request is on the lane
  std::optional<absl::Status> result = SummonLocked(request, response, timeout);
  mu_.Unlock();
  return result;
}

std::optional<absl::Status> TransitionLane::SummonLocked(const v1::SummonRequest& request,
                                                         v1::SummonResponse* response,
                                                         absl::Duration timeout) {
  if (unsupported_) return std::nullopt;
  // Not connected: the unary call retries what never reached the daemon.
  if (channel_->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) return std::nullopt;
  if (stream_ == nullptr) {
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { Watch(); });
    context_ = std::make_unique<grpc::ClientContext>();
    context_->set_wait_for_ready(false);
    stream_ = stub_->Transitions(context_.get());
  }
  v1::LaneRequest lane_request;
  *lane_request.mutable_summon() = request;
  lane_request.set_timeout_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(timeout)));
  if (!stream_->Write(lane_request)) {
    // The stream had ended (a restarted daemon, a shutdown): the request never went out.
    const grpc::Status ended = CloseStream(/*cancel=*/false);
    FS_VLOG(1) << "transition lane closed (" << ended.error_message() << "); unary Summon";
    if (ended.error_code() == grpc::StatusCode::UNIMPLEMENTED) unsupported_ = true;
    return std::nullopt;
  }
  {
    absl::MutexLock watch(&watch_mu_);
    watched_ = context_.get();
    watch_deadline_ = absl::Now() + timeout;
    timed_out_ = false;
  }
  v1::LaneReply reply;
  const bool read = stream_->Read(&reply);
  bool timed_out;
  {
    absl::MutexLock watch(&watch_mu_);
    watched_ = nullptr;
    timed_out = timed_out_;
  }
  if (read) {
    if (reply.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
    }
    *response = std::move(*reply.mutable_summon());
    return absl::OkStatus();
  }
  const grpc::Status ended = CloseStream(/*cancel=*/false);
  if (ended.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    unsupported_ = true;  // the daemon refused the stream: nothing ran
    return std::nullopt;
  }
  if (timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat("Summon: no answer from flatshardd within ", absl::FormatDuration(timeout)));
  }
  return absl::UnavailableError(
      absl::StrCat("Summon: the connection to flatshardd ended before its answer (",
                   ended.error_message().empty() ? "stream closed" : ended.error_message(),
                   "); whether the summon ran is unknown"));
}

}  // namespace flatshard::client::internal
