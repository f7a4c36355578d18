#include "server/publish/weights_peer_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/group_manager.h"
#include "server/publish/publish_rounds.h"
#include "server/publish/publisher.h"
#include "server/publish/ucx_weights_link.h"

namespace flatshard::server {
namespace {

constexpr int64_t kChunk = 4 << 20;  // bytes per message

v1::DType ToProtoDType(DType d) { return static_cast<v1::DType>(static_cast<int>(d) + 1); }

absl::Time DeadlineOf(int64_t wait_ms) {
  return absl::Now() + absl::Milliseconds(std::max<int64_t>(0, wait_ms));
}

// A WatchVersions stream's queue: the publisher delivers on its threads, the handler writes.
class QueuedVersions final : public WeightsWatcher {
 public:
  void Deliver(const WeightsInfo& version) override {
    absl::MutexLock lock(&mu_);
    queue_.push_back(version);
  }
  void End(const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    if (end_.ok()) end_ = why;
  }
  // The versions delivered so far; waits up to `wait` for one or for End (then `*end` is its
  // status, else OK).
  std::deque<WeightsInfo> Take(absl::Duration wait, absl::Status* end) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(this, &QueuedVersions::ReadyLocked), wait);
    *end = end_;
    return std::exchange(queue_, {});
  }

 private:
  bool ReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || !end_.ok();
  }
  absl::Mutex mu_;
  std::deque<WeightsInfo> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void WeightsPeerServiceImpl::SetTargets(GroupManager* groups, Publisher* publisher,
                                        PublishRounds* rounds) {
  groups_.store(groups);
  publisher_.store(publisher);
  rounds_.store(rounds);
}

grpc::Status WeightsPeerServiceImpl::ReadShards(grpc::ServerContext* ctx,
                                                const v1::ReadShardsRequest* request,
                                                grpc::ServerWriter<v1::ShardChunk>* writer) {
  GroupManager* groups = groups_.load();
  PublishRounds* rounds = rounds_.load();
  if (groups == nullptr || rounds == nullptr || stopped_.load()) {
    return ToGrpcStatus(absl::UnavailableError("flatshardd is not serving published weights"));
  }
  const absl::Time deadline = DeadlineOf(request->wait_ms());
  // The publish is collective: this daemon's ranks must have called it too.
  if (absl::Status s =
          rounds->TakeArrival(request->group(), request->module(), request->seq(), deadline);
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  CheckpointArgs args;
  args.group = request->group();
  args.module = request->module();
  args.token = request->token();
  args.from_peer = true;
  args.wait = std::max(absl::Seconds(1), deadline - absl::Now());
  const absl::Status s = groups->ReadCommitted(args, [&](const CommittedCopies& c) {
    v1::ShardChunk header;
    header.set_generation(c.generation);
    for (int32_t r : c.ranks) header.add_ranks(r);
    if (!writer->Write(header)) return absl::CancelledError("the reading daemon went away");
    v1::ShardChunk chunk;
    for (size_t i = 0; i < c.ranks.size(); ++i) {
      for (const PlanUnit& u : c.plan.units) {
        const std::shared_ptr<Buffer>& b =
            u.index < static_cast<int32_t>(c.by_unit[i].size()) ? c.by_unit[i][u.index] : nullptr;
        if (b == nullptr) continue;
        const int64_t bytes = u.shard_numel * ItemSize(u.dtype);
        for (int64_t off = 0; off < bytes; off += kChunk) {
          chunk.set_rank(c.ranks[i]);
          chunk.set_unit(u.index);
          chunk.set_offset(off);
          chunk.set_data(static_cast<const char*>(b->data()) + off,
                         static_cast<size_t>(std::min(kChunk, bytes - off)));
          if (ctx->IsCancelled() || !writer->Write(chunk)) {
            return absl::CancelledError("the reading daemon went away");
          }
        }
      }
    }
    return absl::OkStatus();
  });
  return ToGrpcStatus(s);
}

grpc::Status WeightsPeerServiceImpl::FetchVersion(grpc::ServerContext* ctx,
                                                  const v1::FetchVersionRequest* request,
                                                  grpc::ServerWriter<v1::VersionChunk>* writer) {
  Publisher* publisher = publisher_.load();
  PublishRounds* rounds = rounds_.load();
  if (publisher == nullptr || rounds == nullptr || stopped_.load()) {
    return ToGrpcStatus(absl::UnavailableError("flatshardd is not serving published weights"));
  }
  WeightsSelector selector{request->name(), request->owner_uid(), request->version(),
                           request->reader_token()};
  int64_t uid = request->reader_uid();
  if (request->seq() > 0) {
    // The version this daemon (the leader) built for a collective publish.
    absl::StatusOr<uint64_t> built =
        rounds->AwaitDone(request->group(), request->module(), request->token(), request->seq(),
                          DeadlineOf(request->wait_ms()));
    if (!built.ok()) return ToGrpcStatus(built.status());
    selector.version = *built;
    uid = 0;  // one of the group's daemons: the token above was the group's
    selector.group_peer = true;
  }
  absl::StatusOr<ExportedVersion> v = publisher->Export(selector, uid);
  if (!v.ok()) return ToGrpcStatus(v.status());
  v1::VersionChunk header;
  const WeightsDescriptor& d = v->descriptor;
  v1::PublishedVersion* info = header.mutable_weights()->mutable_version();
  info->set_name(d.info.name);
  info->set_owner_uid(d.info.owner_uid);
  info->set_version(d.info.version);
  info->set_generation(d.info.generation);
  info->set_bytes(d.info.bytes);
  info->set_tensors(d.info.tensors);
  info->set_group(d.info.group);
  info->set_module(d.info.module);
  for (const WeightsEntry& e : d.tensors) {
    v1::WeightsTensor* t = header.mutable_weights()->add_tensors();
    t->set_name(e.name);
    t->set_dtype(ToProtoDType(e.dtype));
    for (int64_t s : e.shape) t->add_shape(s);
    t->set_offset(static_cast<uint64_t>(e.offset));
    t->set_bytes(static_cast<uint64_t>(e.bytes));
  }
  for (int64_t u : v->reader_uids) header.add_reader_uids(u);
  header.set_reader_token(v->token);
  header.set_not_newer(request->newer_than() > 0 && d.info.version <= request->newer_than());
  if (!writer->Write(header)) return grpc::Status::CANCELLED;
  if (header.not_newer() || request->length() < 0) return grpc::Status::OK;
  if (request->seq() == 0 && testing_copy_pause_ > absl::ZeroDuration()) {
    absl::SleepFor(testing_copy_pause_);
  }
  const int64_t bytes = d.info.bytes;
  if (request->ucx() && ucx_ != nullptr && bytes > 0) {
    // The fetcher reads the bytes itself; access was checked above (Export), so only a reader
    // allowed to open the version gets the rkey. Unmapped when this call ends.
    absl::StatusOr<UcxWeightsLink::Exposure> exposed = ucx_->Expose(v->data, bytes);
    if (exposed.ok()) {
      v1::VersionChunk where;
      where.set_ucx_address(exposed->address);
      where.set_ucx_rkey(exposed->rkey);
      where.set_ucx_base(exposed->base);
      if (testing_ucx_stall_after_ > 0 && ++rkeys_sent_ == testing_ucx_stall_after_) {
        // Before the rkey leaves: none of the copier's get can be served.
        FS_LOG(WARNING) << "testing: this daemon's UCX weights worker stops progressing "
                           "(--testing_weights_ucx_stall_after="
                        << testing_ucx_stall_after_ << ")";
        ucx_->StallForTesting();
      }
      if (!writer->Write(where)) return grpc::Status::CANCELLED;
      const absl::Time until = absl::FromChrono(ctx->deadline());
      while (!ctx->IsCancelled() && !stopped_.load() && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      return ctx->IsCancelled() ? grpc::Status::CANCELLED
                                : ToGrpcStatus(absl::UnavailableError(
                                      "the hold on the version ended (deadline or shutdown)"));
    }
    FS_LOG(WARNING) << "weights \"" << d.info.name << "\" version " << d.info.version
                    << ": sending the bytes over gRPC: " << exposed.status();
  }
  const int64_t lo = std::clamp<int64_t>(request->offset(), 0, bytes);
  const int64_t hi = request->length() == 0 ? bytes : std::min(bytes, lo + request->length());
  v1::VersionChunk chunk;
  for (int64_t off = lo; off < hi; off += kChunk) {
    chunk.set_offset(off);
    chunk.set_data(v->data + off, static_cast<size_t>(std::min(kChunk, hi - off)));
    if (ctx->IsCancelled() || !writer->Write(chunk)) return grpc::Status::CANCELLED;
  }
  return grpc::Status::OK;
}

grpc::Status WeightsPeerServiceImpl::WatchVersions(
    grpc::ServerContext* ctx, const v1::WatchVersionsRequest* request,
    grpc::ServerWriter<v1::PublishedVersion>* writer) {
  Publisher* publisher = publisher_.load();
  if (publisher == nullptr || stopped_.load()) {
    return ToGrpcStatus(absl::UnavailableError("flatshardd is not serving published weights"));
  }
  const absl::Time deadline = DeadlineOf(request->wait_ms());
  auto queue = std::make_shared<QueuedVersions>();
  absl::StatusOr<uint64_t> id =
      publisher->Watch({request->name(), request->owner_uid(), 0, request->reader_token()},
                       request->reader_uid(), request->after(), queue);
  if (!id.ok()) return ToGrpcStatus(id.status());
  grpc::Status status = grpc::Status::OK;
  // The watch is registered: the follower counts the stream open (version 0).
  if (!writer->Write(v1::PublishedVersion())) status = grpc::Status::CANCELLED;
  while (status.ok() && absl::Now() < deadline) {
    if (ctx->IsCancelled()) {
      status = grpc::Status::CANCELLED;
      break;
    }
    if (stopped_.load()) {
      status = ToGrpcStatus(absl::UnavailableError("flatshardd is shutting down"));
      break;
    }
    v1::PublishedVersion out;
    absl::Status end;
    for (const WeightsInfo& v :
         queue->Take(std::min(absl::Milliseconds(100), deadline - absl::Now()), &end)) {
      if (v.device >= 0) continue;  // in GPU memory: never copied to other daemons
      out.set_name(v.name);
      out.set_owner_uid(v.owner_uid);
      out.set_version(v.version);
      out.set_generation(v.generation);
      out.set_bytes(v.bytes);
      if (!writer->Write(out)) {
        status = grpc::Status::CANCELLED;
        break;
      }
    }
    if (status.ok() && !end.ok()) status = ToGrpcStatus(end);  // the publisher stopped
    if (!status.ok()) break;
  }
  publisher->Unwatch(*id);
  return status;
}

}  // namespace flatshard::server
