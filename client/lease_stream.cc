#include "client/lease_stream.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace flatshard::client::internal {

std::string SessionLabel(const v1::Caller& c) {
  return absl::StrCat("group=", c.group(), " rank=", c.rank(), " session=", c.session());
}

void LeaseStream::Run() {
  std::unique_ptr<grpc::ClientReaderWriter<v1::LeaseRequest, v1::LeaseResponse>> stream =
      stub_->Lease(&context_);
  v1::LeaseRequest first;
  *first.mutable_caller() = caller_;
  if (stream->Write(first)) {
    {
      absl::MutexLock lock(&mu_);
      written_ = true;
      stream_ = stream.get();
    }
    // The daemon sends nothing, or acknowledgements we need not act on; Read returns false
    // when the stream ends (the daemon finished it, the connection broke, or Stop()).
    v1::LeaseResponse response;
    while (stream->Read(&response)) {
    }
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
    mu_.Await(absl::Condition(
        +[](bool* running) { return !*running; }, &writes_done_running_));
  }
  const grpc::Status s = stream->Finish();
  absl::MutexLock lock(&mu_);
  done_ = true;
  if (stopping_) {
    end_status_ = absl::FailedPreconditionError("the lease was closed by this client");
  } else if (s.ok()) {
    end_status_ = absl::UnavailableError("the daemon closed the lease");
  } else {
    end_status_ = FromGrpcStatus(s);
  }
  if (!stopping_) {
    FS_LOG(WARNING) << "lease of " << SessionLabel(caller_) << " ended: " << end_status_;
  }
}

void LeaseStream::Stop(absl::Duration wait_for_end) {
  grpc::ClientReaderWriter<v1::LeaseRequest, v1::LeaseResponse>* open = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (wait_for_end > absl::ZeroDuration() && !done_ && stream_ != nullptr) {
      open = stream_;
      writes_done_running_ = true;
    }
  }
  if (open != nullptr) {
    // A write beside Run's read is allowed; Run finishes the stream only after this returned.
    open->WritesDone();
    absl::MutexLock lock(&mu_);
    writes_done_running_ = false;
    mu_.AwaitWithTimeout(absl::Condition(&done_), wait_for_end);
  }
  context_.TryCancel();  // before the call started: cancels it when it starts
  if (thread_.joinable()) thread_.join();
}

}  // namespace flatshard::client::internal
