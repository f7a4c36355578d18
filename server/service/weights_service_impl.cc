#include "server/service/weights_service_impl.h"

#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/proto_convert.h"
#include "common/status_macros.h"
#include "server/access/access_control.h"
#include "server/metrics/metered_reactor.h"
#include "server/publish/weights_puller.h"

namespace flatshard::server {
namespace {

// proto DType = client DType + 1 (0 is UNSPECIFIED); see types.proto.
v1::DType ToProtoDType(DType d) { return static_cast<v1::DType>(static_cast<int>(d) + 1); }

void FillInfo(const WeightsInfo& i, v1::PublishedVersion* out) {
  out->set_name(i.name);
  out->set_owner_uid(i.owner_uid);
  out->set_version(i.version);
  out->set_generation(i.generation);
  out->set_bytes(i.bytes);
  out->set_tensors(i.tensors);
  out->set_readers(i.readers);
  out->set_group(i.group);
  out->set_module(i.module);
  if (i.device >= 0) out->set_device(i.device);
}

void FillDescriptor(const WeightsDescriptor& d, v1::OpenWeightsResponse* out) {
  FillInfo(d.info, out->mutable_version());
  out->set_segment(d.segment);
  out->set_segment_bytes(static_cast<uint64_t>(d.segment_bytes));
  out->set_ipc_handle(d.ipc_handle);
  out->set_device_uuid(d.device_uuid);
  out->set_offset(static_cast<uint64_t>(d.offset));
  for (const WeightsEntry& e : d.tensors) {
    v1::WeightsTensor* t = out->add_tensors();
    t->set_name(e.name);
    t->set_dtype(ToProtoDType(e.dtype));
    for (int64_t s : e.shape) t->add_shape(s);
    t->set_offset(static_cast<uint64_t>(e.offset));
    t->set_bytes(static_cast<uint64_t>(e.bytes));
  }
}

absl::StatusOr<WeightsSelector> SelectorOf(absl::string_view method, const v1::WeightsSelector& s) {
  if (s.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(method, ": selector.name is empty"));
  }
  FS_RETURN_IF_ERROR(CheckLength(method, "selector.name", s.name(), kMaxGroupBytes));
  FS_RETURN_IF_ERROR(CheckLength(method, "selector.token", s.token(), kMaxTokenBytes));
  return WeightsSelector{s.name(), s.owner_uid(), s.version(), s.token()};
}

template <typename Reactor>
Reactor* Refuse(Reactor* reactor, const absl::Status& status) {
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

class OpenReactor;

// What the publisher holds of a lease's stream (and the stream's state, which the reactor's
// callbacks and the publisher's Shutdown share): it outlives the reactor. Finish runs once,
// by whichever of them sets finished_; the reactor lives until then.
class LeaseStream final : public WeightsLeaseHolder {
 public:
  explicit LeaseStream(OpenReactor* reactor) : reactor_(reactor) {}
  // The daemon stops: the stream ends with `why` (after the descriptor's write, if under way).
  void End(const absl::Status& why) override;
  // The reactor's callbacks. Each returns true when the caller finishes the stream now,
  // with `*status`.
  bool Opened(const absl::Status& refused, grpc::Status* status);
  bool WriteDone(bool ok, grpc::Status* status);
  bool Cancel(grpc::Status* status);
  void Done() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
    finished_ = true;
  }

 private:
  absl::Mutex mu_;
  OpenReactor* reactor_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = true;  // the descriptor, from the constructor on
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);  // End's reason, once it came
};

// A reader's lease: writes the descriptor, then holds the version until the call ends (or
// the daemon stops: LeaseStream::End).
class OpenReactor final : public grpc::ServerWriteReactor<v1::OpenWeightsResponse> {
 public:
  // `puller` (may be null): the version is first copied from --weights_sources when needed,
  // on the puller's thread; the call counts as writing meanwhile (a cancel waits for it).
  OpenReactor(Publisher* publisher, RequestWorkers* workers, WeightsPuller* puller,
              absl::StatusOr<int64_t> uid, const v1::OpenWeightsRequest& request)
      : publisher_(publisher), workers_(workers), stream_(std::make_shared<LeaseStream>(this)) {
    absl::StatusOr<WeightsSelector> sel = SelectorOf("OpenWeights", request.selector());
    absl::Status s = uid.ok() ? sel.status() : uid.status();
    if (!s.ok()) {
      OpenNow(WeightsSelector(), -1, s);
      return;
    }
    if (puller == nullptr) {
      OpenNow(*sel, *uid, absl::OkStatus());
      return;
    }
    puller->RefreshAsync(*sel, *uid, [this, sel = *sel, uid = *uid](absl::Status pulled) {
      OpenNow(sel, uid, pulled);
    });
  }
  void OnWriteDone(bool ok) override {
    grpc::Status status;
    if (stream_->WriteDone(ok, &status)) End(status);
  }
  void OnCancel() override {
    grpc::Status status;
    if (stream_->Cancel(&status)) End(status);
  }
  void OnDone() override {
    Release();
    stream_->Done();
    delete this;
  }
  // Releases the lease and finishes the call (once: see LeaseStream).
  void End(grpc::Status status) {
    Release();
    Finish(std::move(status));
  }

 private:
  // The last lease of a dropped or trimmed version frees it: an munmap of up to GiBs
  // (0.16 s/GiB), so the release runs on a request worker (a strand per lease), never on the
  // gRPC thread or the publisher's Shutdown that ended the stream. Posted by OnDone at the
  // latest, so Daemon::Shutdown runs it after the server stopped, before the store stops.
  void Release() {
    if (lease_ == 0) return;
    const uint64_t lease = std::exchange(lease_, 0);
    workers_->Post(absl::StrCat("OpenWeights lease ", lease),
                   [publisher = publisher_, lease] { publisher->Release(lease); });
  }
  // Takes the lease and writes the descriptor (unless `s` refused it already).
  void OpenNow(const WeightsSelector& sel, int64_t uid, absl::Status s) {
    if (s.ok()) {
      absl::StatusOr<WeightsDescriptor> d = publisher_->Open(sel, uid, &lease_, stream_);
      if (d.ok()) {
        FillDescriptor(*d, &response_);
      } else {
        s = d.status();
        lease_ = 0;
      }
    }
    grpc::Status status;
    if (stream_->Opened(s, &status)) {
      End(status);
    } else {
      StartWrite(&response_);
    }
  }

  Publisher* const publisher_;
  RequestWorkers* const workers_;
  const std::shared_ptr<LeaseStream> stream_;
  v1::OpenWeightsResponse response_;
  uint64_t lease_ = 0;  // 0: none (refused, or released)
};

bool LeaseStream::Opened(const absl::Status& refused, grpc::Status* status) {
  absl::MutexLock lock(&mu_);
  if (refused.ok() && !cancelled_ && end_.ok()) return false;  // the descriptor goes out
  writing_ = false;
  finished_ = true;
  *status = !refused.ok() ? ToGrpcStatus(refused)
            : cancelled_  ? grpc::Status::CANCELLED
                          : ToGrpcStatus(end_);
  return true;
}

bool LeaseStream::WriteDone(bool ok, grpc::Status* status) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  if (finished_ || (ok && !cancelled_ && end_.ok())) return false;  // held until the call ends
  finished_ = true;
  *status = !ok || cancelled_ ? grpc::Status::CANCELLED : ToGrpcStatus(end_);
  return true;
}

bool LeaseStream::Cancel(grpc::Status* status) {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (writing_ || finished_) return false;  // WriteDone or Opened finishes
  finished_ = true;
  *status = grpc::Status::CANCELLED;
  return true;
}

void LeaseStream::End(const absl::Status& why) {
  OpenReactor* reactor = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || !end_.ok()) return;
    end_ = why;
    if (writing_) return;  // WriteDone (or Opened) finishes with it
    finished_ = true;
    reactor = reactor_;
  }
  // Alive: it is deleted in OnDone, after the Finish only this call makes now.
  if (reactor != nullptr) reactor->End(ToGrpcStatus(why));
}

class WatchReactor;

// What the publisher holds of a watch: it outlives the reactor and does nothing once the
// stream ended.
class WatchSink final : public WeightsWatcher {
 public:
  explicit WatchSink(WatchReactor* reactor) : reactor_(reactor) {}
  void Deliver(const WeightsInfo& version) override;
  // The daemon stops: the stream ends with `why` (after the write in flight, if any).
  void End(const absl::Status& why) override { Close(ToGrpcStatus(why)); }
  // The reactor's callbacks (serialized per reactor by the state below).
  void WriteDone(bool ok);
  void Cancel() { Close(grpc::Status::CANCELLED); }
  void Done() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
    closed_ = true;
  }

 private:
  // Ends the stream with `status` unless it has ended (or is ending) already.
  void Close(const grpc::Status& status);
  absl::Mutex mu_;
  WatchReactor* reactor_ ABSL_GUARDED_BY(mu_);
  grpc::Status end_ ABSL_GUARDED_BY(mu_);                        // what Finish reports once closed_
  std::deque<v1::PublishedVersion> queue_ ABSL_GUARDED_BY(mu_);  // front: being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class WatchReactor final : public grpc::ServerWriteReactor<v1::PublishedVersion> {
 public:
  // `follower` (may be null: no --weights_sources): the name is followed at the sources
  // while this watch is open (weights_follower.h).
  WatchReactor(Publisher* publisher, WeightsFollower* follower, absl::StatusOr<int64_t> uid,
               const v1::WatchWeightsRequest& request)
      : publisher_(publisher), follower_(follower), sink_(std::make_shared<WatchSink>(this)) {
    absl::StatusOr<WeightsSelector> sel = SelectorOf("WatchWeights", request.selector());
    absl::Status s = uid.ok() ? sel.status() : uid.status();
    if (s.ok()) {
      absl::StatusOr<uint64_t> id = publisher_->Watch(*sel, *uid, sel->version, sink_);
      if (id.ok()) {
        watch_ = *id;
        if (follower_ != nullptr) follow_ = follower_->Follow(*sel, *uid);
      } else {
        s = id.status();
      }
    }
    if (!s.ok()) {
      sink_->Done();
      Finish(ToGrpcStatus(s));
    }
  }
  void OnWriteDone(bool ok) override { sink_->WriteDone(ok); }
  void OnCancel() override {
    Unwatch();
    sink_->Cancel();
  }
  void OnDone() override {
    Unwatch();
    sink_->Done();
    delete this;
  }

 private:
  void Unwatch() {
    if (watch_ != 0) publisher_->Unwatch(std::exchange(watch_, 0));
    if (follow_ != 0) follower_->Unfollow(std::exchange(follow_, 0));
  }
  Publisher* const publisher_;
  WeightsFollower* const follower_;
  const std::shared_ptr<WatchSink> sink_;
  uint64_t watch_ = 0;
  uint64_t follow_ = 0;
};

void WatchSink::Deliver(const WeightsInfo& version) {
  WatchReactor* reactor = nullptr;
  const v1::PublishedVersion* msg = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (closed_ || reactor_ == nullptr) return;
    queue_.emplace_back();
    FillInfo(version, &queue_.back());
    if (writing_) return;
    writing_ = true;
    reactor = reactor_;
    msg = &queue_.front();
  }
  // The reactor lives until Finish, which waits for this write (writing_).
  reactor->StartWrite(msg);
}

void WatchSink::WriteDone(bool ok) {
  WatchReactor* reactor = nullptr;
  const v1::PublishedVersion* next = nullptr;
  bool finish = false;
  grpc::Status end;
  {
    absl::MutexLock lock(&mu_);
    if (!queue_.empty()) queue_.pop_front();
    if (!ok && !closed_) {
      closed_ = true;
      end_ = grpc::Status::CANCELLED;
    }
    if (closed_) {
      writing_ = false;
      if (!finished_) finish = finished_ = true;
      end = end_;
    } else if (!queue_.empty()) {
      next = &queue_.front();
    } else {
      writing_ = false;
    }
    reactor = reactor_;
  }
  if (finish && reactor != nullptr) reactor->Finish(end);
  if (next != nullptr && reactor != nullptr) reactor->StartWrite(next);
}

void WatchSink::Close(const grpc::Status& status) {
  WatchReactor* reactor = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;  // the first reason stands
    closed_ = true;
    end_ = status;
    if (writing_ || finished_) return;  // WriteDone finishes
    finished_ = true;
    reactor = reactor_;
  }
  if (reactor != nullptr) reactor->Finish(status);
}

}  // namespace

absl::StatusOr<int64_t> WeightsServiceImpl::CallerUid(
    const grpc::CallbackServerContext* ctx) const {
  if (access_ == nullptr) return access::kRemoteUid;
  return access_->CallerUid(ctx->peer());
}

grpc::ServerUnaryReactor* WeightsServiceImpl::Publish(grpc::CallbackServerContext* ctx,
                                                      const v1::PublishRequest* request,
                                                      v1::PublishResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "Publish");
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return Refuse(reactor, uid.status());
  for (const auto& [field, value, max] :
       {std::tuple<const char*, const std::string&, size_t>{
            "caller.group", request->caller().group(), kMaxGroupBytes},
        {"caller.token", request->caller().token(), kMaxTokenBytes},
        {"registered_module", request->registered_module(), kMaxModulePathBytes},
        {"name", request->name(), kMaxGroupBytes},
        {"options.reader_token", request->options().reader_token(), kMaxTokenBytes}}) {
    if (absl::Status s = CheckLength("Publish", field, value, max); !s.ok()) {
      return Refuse(reactor, s);
    }
  }
  PublishArgs args;
  args.caller = flatshard::FromProto(request->caller());
  args.caller.uid = *uid;
  args.module = request->registered_module();
  args.name = request->name();
  const int dtype = static_cast<int>(request->options().dtype());
  if (dtype < 0 || dtype > static_cast<int>(v1::DTYPE_BOOL)) {
    return Refuse(reactor, absl::InvalidArgumentError(
                               absl::StrCat("Publish: options.dtype ", dtype, " is unknown")));
  }
  if (dtype != 0) args.dtype = static_cast<DType>(dtype - 1);
  args.reader_uids.assign(request->options().reader_uids().begin(),
                          request->options().reader_uids().end());
  args.reader_token = request->options().reader_token();
  if (request->options().has_device()) {
    if (request->options().device() < 0) {
      return Refuse(reactor, absl::InvalidArgumentError(absl::StrCat(
                                 "Publish: options.device must be a GPU ordinal >= 0, got ",
                                 request->options().device())));
    }
    args.device = request->options().device();
  }
  // Answer a little before the client gives up, so it gets the message naming missing ranks.
  const absl::Time now = absl::Now();
  absl::Time deadline = std::min(absl::FromChrono(ctx->deadline()), now + default_wait_);
  deadline -= std::min(absl::Seconds(1), std::max(absl::Milliseconds(30), (deadline - now) / 10));
  args.deadline = deadline;
  publisher_->Publish(std::move(args), [reactor, response](absl::StatusOr<WeightsInfo> result) {
    if (result.ok()) FillInfo(*result, response->mutable_version());
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerWriteReactor<v1::OpenWeightsResponse>* WeightsServiceImpl::OpenWeights(
    grpc::CallbackServerContext* ctx, const v1::OpenWeightsRequest* request) {
  return new OpenReactor(publisher_, workers_, puller_, CallerUid(ctx), *request);
}

grpc::ServerWriteReactor<v1::PublishedVersion>* WeightsServiceImpl::WatchWeights(
    grpc::CallbackServerContext* ctx, const v1::WatchWeightsRequest* request) {
  return new WatchReactor(publisher_, puller_ != nullptr ? puller_->follower() : nullptr,
                          CallerUid(ctx), *request);
}

grpc::ServerUnaryReactor* WeightsServiceImpl::ListWeights(grpc::CallbackServerContext* ctx,
                                                          const v1::ListWeightsRequest* request,
                                                          v1::ListWeightsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "ListWeights");
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return Refuse(reactor, uid.status());
  if (absl::Status s = CheckLength("ListWeights", "name", request->name(), kMaxGroupBytes);
      !s.ok()) {
    return Refuse(reactor, s);
  }
  for (const WeightsInfo& i : publisher_->List(*uid, request->name())) {
    FillInfo(i, response->add_versions());
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WeightsServiceImpl::InspectWeights(
    grpc::CallbackServerContext* ctx, const v1::InspectWeightsRequest* request,
    v1::InspectWeightsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "InspectWeights");
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return Refuse(reactor, uid.status());
  absl::StatusOr<WeightsSelector> sel = SelectorOf("InspectWeights", request->selector());
  if (!sel.ok()) return Refuse(reactor, sel.status());
  absl::StatusOr<WeightsDescriptor> d = publisher_->Inspect(*sel, *uid);
  if (d.ok()) FillDescriptor(*d, response->mutable_weights());
  reactor->Finish(ToGrpcStatus(d.status()));
  return reactor;
}

grpc::ServerUnaryReactor* WeightsServiceImpl::DropWeights(grpc::CallbackServerContext* ctx,
                                                          const v1::DropWeightsRequest* request,
                                                          v1::DropWeightsResponse* response) {
  metrics::MeteredReactor* reactor = metrics::MeteredReactor::New(ctx, "DropWeights");
  absl::StatusOr<int64_t> uid = CallerUid(ctx);
  if (!uid.ok()) return Refuse(reactor, uid.status());
  absl::StatusOr<WeightsSelector> sel = SelectorOf("DropWeights", request->selector());
  if (!sel.ok()) return Refuse(reactor, sel.status());
  // Posted: a dropped version's file goes and its segment is unmapped (a GiB: 0.5 s).
  workers_->Post("DropWeights", [this, reactor, response, sel = *std::move(sel), uid = *uid] {
    absl::StatusOr<int> n = publisher_->Drop(sel, uid);
    if (n.ok()) response->set_dropped(*n);
    reactor->Finish(ToGrpcStatus(n.status()));
  });
  return reactor;
}

}  // namespace flatshard::server
