#include "server/peer/peer_service_impl.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/peer/peer_proto.h"

namespace flatshard::server::peer {

// One daemon's Watch stream. Owned by itself (`self_`) until gRPC calls OnDone; the
// Coordinator (as a WatchSink) and the heartbeat loop hold it only briefly or weakly, and
// everything they call is a no-op once the stream is finishing. One write in flight at a time;
// the rest queue, and a heartbeat is dropped while anything else is queued (it would carry no
// news).
class PeerServiceImpl::WatchReactor final
    : public grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent>,
      public WatchSink,
      public std::enable_shared_from_this<WatchReactor> {
 public:
  explicit WatchReactor(PeerServiceImpl* service) : service_(service) {}

  void Start(std::shared_ptr<WatchReactor> self) {
    self_ = std::move(self);
    StartRead(&request_);
  }

  void SendHeartbeat() {
    v1::WatchEvent e;
    e.set_heartbeat(true);
    Send(std::move(e), /*heartbeat=*/true);
  }

  void PushTable(const PeerTable& table) override {
    v1::WatchEvent e;
    internal::ToProto(table, e.mutable_table());
    Send(std::move(e), false);
  }
  void PushFailure(const std::string& group, uint64_t epoch, const absl::Status& status) override {
    v1::WatchEvent e;
    internal::ToProto(group, epoch, status, e.mutable_failure());
    Send(std::move(e), false);
  }
  void Close(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;  // the coordinator has already forgotten this stream
    }
    RequestFinish(ToGrpcStatus(status));
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End("its watch stream was closed", grpc::Status::OK);
      return;
    }
    std::optional<Coordinator::WatcherId> id;
    {
      absl::MutexLock lock(&mu_);
      id = id_;
    }
    if (id.has_value()) {
      service_->coordinator_.Heartbeat(*id);
    } else {
      if (!request_.has_daemon()) {
        RequestFinish(ToGrpcStatus(
            absl::InvalidArgumentError("watch: the first message must name the daemon")));
        return;
      }
      absl::StatusOr<Coordinator::WatcherId> watched =
          service_->coordinator_.Watch(internal::FromProto(request_.daemon()), shared_from_this());
      if (!watched.ok()) {
        RequestFinish(ToGrpcStatus(watched.status()));
        return;
      }
      bool ended;
      {
        absl::MutexLock lock(&mu_);
        id_ = *watched;
        ended = ended_;
      }
      // The stream broke while we registered it: OnCancel found no id to unwatch.
      if (ended) {
        service_->coordinator_.Unwatch(*watched, "its watch stream broke");
        return;
      }
      SendHeartbeat();  // the daemon learns at once that the stream is up
    }
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    bool write_next = false;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (ok && !finish_.has_value() && !queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        write_next = true;
      } else {
        writing_ = false;
        queue_.clear();
        if (finish_.has_value() && !finished_) {
          finished_ = true;
          finish = *finish_;
        }
      }
    }
    if (write_next) {
      StartWrite(&current_);
    } else if (finish.has_value()) {
      Finish(*finish);
    }
  }

  void OnCancel() override { End("its watch stream broke", grpc::Status::CANCELLED); }

  void OnDone() override {
    service_->Forget(this);
    End("its watch stream ended", grpc::Status::CANCELLED);
    std::shared_ptr<WatchReactor> keep = std::move(self_);  // may be the last owner
  }

 private:
  void Send(v1::WatchEvent e, bool heartbeat) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_.has_value()) return;
      if (writing_) {
        if (!heartbeat || queue_.empty()) queue_.push_back(std::move(e));
        return;
      }
      writing_ = true;
      current_ = std::move(e);
    }
    StartWrite(&current_);
  }

  // The stream ended from the daemon's side: it is dead unless a newer stream replaced it.
  void End(absl::string_view why, const grpc::Status& status) {
    std::optional<Coordinator::WatcherId> id;
    {
      absl::MutexLock lock(&mu_);
      if (ended_) {
        id.reset();
      } else {
        ended_ = true;
        id = id_;
      }
    }
    if (id.has_value()) service_->coordinator_.Unwatch(*id, why);
    RequestFinish(status);
  }

  void RequestFinish(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_.has_value()) return;
      finish_ = status;
      queue_.clear();
      if (writing_) return;  // OnWriteDone finishes
      finished_ = true;
    }
    Finish(status);
  }

  PeerServiceImpl* const service_;
  std::shared_ptr<WatchReactor> self_;
  v1::WatchRequest request_;  // touched by the serialized read reactions only

  absl::Mutex mu_;
  std::optional<Coordinator::WatcherId> id_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  v1::WatchEvent current_;  // owned by the write in flight
  std::deque<v1::WatchEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

PeerServiceImpl::PeerServiceImpl(PeerOptions options)
    : options_(std::move(options)),
      coordinator_(CoordinatorOptions{options_.peer_timeout, nullptr,
                                      static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))}) {
  timer_ = std::thread([this] { TimerLoop(); });
}

PeerServiceImpl::~PeerServiceImpl() { Shutdown(); }

void PeerServiceImpl::Shutdown() {
  coordinator_.Shutdown();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  if (timer_.joinable()) timer_.join();
}

void PeerServiceImpl::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void PeerServiceImpl::Forget(WatchReactor* reactor) {
  absl::MutexLock lock(&mu_);
  streams_.erase(reactor);
}

// Sleeps until the coordinator's next deadline, the next heartbeat, a Wake() (a new rendezvous
// may carry an earlier deadline) or Shutdown().
void PeerServiceImpl::TimerLoop() {
  absl::Time next_heartbeat = absl::Now() + options_.heartbeat_interval;
  while (true) {
    const absl::Time until = std::min(coordinator_.NextDeadline(), next_heartbeat);
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || wake_; };
      mu_.AwaitWithDeadline(absl::Condition(&woken), until);
      if (stop_) return;
      wake_ = false;
    }
    coordinator_.ExpireDeadlines();
    if (absl::Now() < next_heartbeat) continue;
    next_heartbeat = absl::Now() + options_.heartbeat_interval;
    std::vector<std::shared_ptr<WatchReactor>> streams;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [raw, weak] : streams_) {
        if (auto s = weak.lock()) streams.push_back(std::move(s));
      }
    }
    for (const auto& s : streams) s->SendHeartbeat();
  }
}

grpc::ServerUnaryReactor* PeerServiceImpl::Rendezvous(grpc::CallbackServerContext* ctx,
                                                      const v1::RendezvousRequest* request,
                                                      v1::RendezvousResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time now = absl::Now();
  const absl::Time fallback = now + kDefaultRendezvousWait;
  absl::Time deadline = absl::FromChrono(ctx->deadline());
  // Answer a little before the caller gives up, so it gets our message naming the missing
  // ranks rather than a bare "Deadline Exceeded"; gRPC rounds the timeout it sends.
  if (deadline < fallback) {
    deadline -= std::min(absl::Seconds(1), std::max(absl::Milliseconds(30), (deadline - now) / 10));
  }
  deadline = std::min(deadline, fallback);

  RendezvousArgs args;
  args.group = request->group();
  args.token = request->token();
  args.world_size = request->world_size();
  args.rank = request->rank();
  args.failed_epoch = request->failed_epoch();
  args.device_uuid = request->device_uuid();
  args.nccl_unique_id = request->nccl_unique_id();
  args.registered_modules.assign(request->registered_modules().begin(),
                                 request->registered_modules().end());
  args.daemon = internal::FromProto(request->daemon());
  coordinator_.Rendezvous(args, deadline, [reactor, response](absl::StatusOr<PeerTable> table) {
    if (table.ok()) internal::ToProto(*table, response->mutable_table());
    reactor->Finish(ToGrpcStatus(table.status()));
  });
  Wake();
  return reactor;
}

grpc::ServerUnaryReactor* PeerServiceImpl::Depart(grpc::CallbackServerContext* ctx,
                                                  const v1::DepartRequest* request,
                                                  v1::DepartResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(coordinator_.Depart(request->group(), request->token(),
                                                   request->rank(), request->daemon_id())));
  return reactor;
}

grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent>* PeerServiceImpl::Watch(
    grpc::CallbackServerContext*) {
  auto reactor = std::make_shared<WatchReactor>(this);
  {
    absl::MutexLock lock(&mu_);
    streams_[reactor.get()] = reactor;
  }
  reactor->Start(reactor);
  WatchReactor* raw = reactor.get();
  return raw;
}

grpc::ServerUnaryReactor* PeerServiceImpl::ReportFailure(grpc::CallbackServerContext* ctx,
                                                         const v1::ReportFailureRequest* request,
                                                         v1::ReportFailureResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const v1::GroupFailure& f = request->failure();
  absl::Status status = f.code() == 0 ? absl::OkStatus() : internal::StatusFromProto(f);
  reactor->Finish(ToGrpcStatus(coordinator_.ReportFailure(request->token(), request->daemon_id(),
                                                          f.group(), f.epoch(), status)));
  return reactor;
}

grpc::Status PeerServiceImpl::Ping(grpc::ServerContext*, const v1::PeerPingRequest* request,
                                   v1::PeerPingResponse*) {
  if (coordinator_.HeartbeatOf(request->daemon_id())) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::NOT_FOUND,
                      absl::StrCat("ping: daemon ", request->daemon_id(), " has no watch stream"));
}

}  // namespace flatshard::server::peer
