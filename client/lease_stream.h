#pragma once
// The client's lease: one Lease stream per session, opened by Join, read on its own thread.

#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatshard/v1/shard_service.grpc.pb.h"

namespace flatshard::client::internal {

// "group=G rank=R session=S", as log lines and errors name a session.
std::string SessionLabel(const v1::Caller& c);

// The session's Lease stream, read on its own thread until the daemon ends it or Stop().
// The stream has no deadline: it lives as long as the session, and its end is the signal.
class LeaseStream {
 public:
  LeaseStream(v1::ShardService::Stub* stub, v1::Caller caller)
      : stub_(stub), caller_(std::move(caller)), thread_([this] { Run(); }) {}
  LeaseStream(const LeaseStream&) = delete;
  LeaseStream& operator=(const LeaseStream&) = delete;
  ~LeaseStream() { Stop(); }

  // OK once the first message (the Caller) is on its way to the daemon; the end status when
  // the stream ended first (e.g. the daemon refused the caller); DEADLINE_EXCEEDED after
  // `timeout`. A refusal that arrives later ends the lease: see status().
  absl::Status WaitStarted(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ || done_; };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (done_) return end_status_;
    if (written_) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat("could not open the lease of ",
                                                    SessionLabel(caller_), " within ",
                                                    absl::FormatDuration(timeout)));
  }

  // OK while the stream is open; why it ended afterwards.
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return done_ ? end_status_ : absl::OkStatus();
  }

  // Ends the stream and joins the thread. Idempotent; not concurrently with itself.
  // `wait_for_end` > 0: first half-closes the stream and waits up to that long for the daemon
  // to finish it, which it does once it ended the session (so the rank can join again at
  // once); then cancels whatever is left.
  void Stop(absl::Duration wait_for_end = absl::ZeroDuration());

 private:
  void Run();

  v1::ShardService::Stub* const stub_;
  const v1::Caller caller_;
  grpc::ClientContext context_;
  mutable absl::Mutex mu_;
  bool written_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The open stream while Run reads it; Stop half-closes it (writes_done_running_) only then,
  // and Run does not Finish it until that WritesDone returned.
  grpc::ClientReaderWriter<v1::LeaseRequest, v1::LeaseResponse>* stream_ ABSL_GUARDED_BY(mu_) =
      nullptr;
  bool writes_done_running_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace flatshard::client::internal
