#include "server/peer/pinger.h"

#include <utility>

namespace flatshard::server::peer {

struct Pinger::Call {
  const void* key = nullptr;
  grpc::ClientContext ctx;
  v1::PeerPingRequest request;
  v1::PeerPingResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::PeerPingResponse>> rpc;
  absl::AnyInvocable<void()> answered;
};

Pinger::Pinger(std::string daemon_id, absl::Duration timeout)
    : daemon_id_(std::move(daemon_id)), timeout_(timeout), thread_([this] { Loop(); }) {}

Pinger::~Pinger() { Close(); }

void Pinger::Ping(const void* key, v1::PeerService::Stub* stub,
                  absl::AnyInvocable<void()> answered) {
  absl::MutexLock lock(&mu_);
  if (closed_ || in_flight_.contains(key)) return;
  auto call = std::make_unique<Call>();
  call->key = key;
  call->answered = std::move(answered);
  call->request.set_daemon_id(daemon_id_);
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  // Started under the lock: Close() cannot shut the queue down before Finish is queued.
  call->rpc = stub->AsyncPing(&call->ctx, call->request, &cq_);
  call->rpc->Finish(&call->response, &call->status, call.get());
  in_flight_[key] = std::move(call);
}

void Pinger::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& [key, call] : in_flight_) call->ctx.TryCancel();
  }
  cq_.Shutdown();
  absl::MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

void Pinger::Loop() {
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok)) {
    Call* done = static_cast<Call*>(tag);
    if (ok && done->status.ok()) done->answered();
    std::unique_ptr<Call> finished;
    {
      absl::MutexLock lock(&mu_);
      auto it = in_flight_.find(done->key);
      if (it != in_flight_.end()) finished = std::move(it->second);
      in_flight_.erase(done->key);
    }
  }
}

}  // namespace flatshard::server::peer
