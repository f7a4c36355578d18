#include "server/publish/weights_peer_client.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "flatshard/v1/weights_peer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/metrics/registry.h"
#include "server/publish/ucx_weights_link.h"
#include "server/shard_store.h"

namespace flatshard::server {
namespace {

// Bytes move for an hour at most after the source's wait (a daemon that dies ends a call).
constexpr absl::Duration kTransfer = absl::Hours(1);
constexpr int64_t kMaxMessage = 64 << 20;

// Every whole version this daemon copied from another (a reader's pull, or the publish
// leader's version on the group's other daemons), by the transport its bytes took.
metrics::CounterFamily& CopiedBytes() {
  static metrics::CounterFamily& f = metrics::DefaultRegistry().AddCounter(
      "flatshard_weights_peer_copied_bytes_total",
      "Bytes of versions of weights this daemon copied from other daemons (pulls for "
      "--weights_sources and a multi-daemon publish's copies from its leader), by transport",
      {"transport"});
  return f;
}

std::string VersionText(const WeightsPeerClient::Fetch& f) {
  if (f.seq > 0) {
    return absl::StrCat("the version publish #", f.seq, " of group ", f.group, " module \"",
                        f.module, "\" built");
  }
  return absl::StrCat(
      "weights \"", f.name, "\" of uid ", f.owner_uid,
      f.version == 0 ? std::string(" (latest)") : absl::StrCat(" version ", f.version));
}

// proto DType = DType + 1 (0 is UNSPECIFIED); see types.proto.
DType FromProtoDType(v1::DType d) { return static_cast<DType>(static_cast<int>(d) - 1); }

CopiedVersion MetaOf(const v1::VersionChunk& h) {
  CopiedVersion c;
  const v1::PublishedVersion& p = h.weights().version();
  c.info = WeightsInfo{p.name(), p.owner_uid(), p.version(), p.generation(), p.bytes(), p.tensors(),
                       0,        p.group(),     p.module()};
  c.layout.bytes = p.bytes();
  for (const v1::WeightsTensor& t : h.weights().tensors()) {
    WeightsEntry e;
    e.name = t.name();
    e.dtype = FromProtoDType(t.dtype());
    e.shape.assign(t.shape().begin(), t.shape().end());
    e.offset = static_cast<int64_t>(t.offset());
    e.bytes = static_cast<int64_t>(t.bytes());
    c.layout.entries.push_back(std::move(e));
  }
  c.reader_uids.assign(h.reader_uids().begin(), h.reader_uids().end());
  c.token = h.reader_token();
  return c;
}

// Faults a fresh destination's pages in (MADV_POPULATE_WRITE, Linux 5.14; older kernels
// refuse it and the copy faults them in) on a thread of its own, from the end backwards in
// 8 MiB steps, while the bytes arrive from the start (the copy runs into fewer faults, each
// page is faulted about once, and a first touch costs far more than the bytes on some VMs:
// README "Publishing weights"). Stop() ends it once the copy is done.
class BackwardPrefault {
 public:
  BackwardPrefault(char* data, int64_t bytes)
      : thread_([this, data, bytes] {
          constexpr int64_t kStep = 8 << 20;
          for (int64_t end = bytes; end > 0 && !stop_.load(); end -= kStep) {
            const int64_t lo = std::max<int64_t>(0, end - kStep) / 4096 * 4096;
            (void)::madvise(data + lo, static_cast<size_t>(end - lo), 23 /*MADV_POPULATE_WRITE*/);
          }
        }) {}
  ~BackwardPrefault() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

WeightsPeerClient::WeightsPeerClient(std::shared_ptr<grpc::ChannelCredentials> credentials,
                                     ShardStore* store, UcxWeightsLink* ucx)
    : credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()),
      store_(store),
      ucx_(ucx) {}

WeightsPeerClient::~WeightsPeerClient() { Shutdown(); }

void WeightsPeerClient::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
}

int64_t WeightsPeerClient::bytes_received() const {
  absl::MutexLock lock(&mu_);
  return received_;
}

std::shared_ptr<grpc::Channel> WeightsPeerClient::ChannelTo(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& ch = channels_[peer];
  if (ch == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    // Bounded reconnect backoff (gRPC's default grows to 120 s, failing calls at once
    // meanwhile): a source that restarts is reached again within a second (as peer_client.cc).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    ch = grpc::CreateCustomChannel(peer, credentials_, args);
  }
  return ch;
}

bool WeightsPeerClient::Track(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return false;
  calls_.insert(ctx);
  return true;
}

void WeightsPeerClient::Untrack(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  calls_.erase(ctx);
}

absl::StatusOr<WeightsPeerClient::Shards> WeightsPeerClient::ReadShards(
    const std::string& peer, const Plan& plan, int64_t owner_uid, const std::string& group,
    const std::string& token, const std::string& module, uint64_t seq, absl::Time deadline) {
  auto stub = v1::WeightsPeerService::NewStub(ChannelTo(peer));
  v1::ReadShardsRequest request;
  request.set_group(group);
  request.set_token(token);
  request.set_module(module);
  request.set_seq(seq);
  request.set_wait_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline + kTransfer));
  if (!Track(&ctx)) return absl::UnavailableError("flatshardd is shutting down");
  auto where = [&](const absl::Status& s) {
    return absl::Status(s.code(),
                        absl::StrCat("reading the committed shards of group ", group, " module \"",
                                     module, "\" from daemon ", peer, ": ", s.message()));
  };
  Shards out;
  absl::Status status;
  {
    std::unique_ptr<grpc::ClientReader<v1::ShardChunk>> reader = stub->ReadShards(&ctx, request);
    v1::ShardChunk chunk;
    bool header = false;
    std::vector<std::vector<int64_t>> got;  // bytes received by rank position and unit
    while (status.ok() && reader->Read(&chunk)) {
      if (!header) {
        header = true;
        out.generation = chunk.generation();
        out.ranks.assign(chunk.ranks().begin(), chunk.ranks().end());
        out.by_unit.assign(out.ranks.size(), {});
        got.assign(out.ranks.size(), std::vector<int64_t>(plan.units.size(), 0));
        for (auto& units : out.by_unit) units.resize(plan.units.size());
        continue;
      }
      const auto pos = std::find(out.ranks.begin(), out.ranks.end(), chunk.rank());
      if (pos == out.ranks.end() || chunk.unit() < 0 ||
          chunk.unit() >= static_cast<int32_t>(plan.units.size())) {
        status = absl::DataLossError(absl::StrCat("a chunk of rank ", chunk.rank(), " unit ",
                                                  chunk.unit(), " it did not announce"));
        break;
      }
      const size_t i = static_cast<size_t>(pos - out.ranks.begin());
      const PlanUnit& u = plan.units[chunk.unit()];
      const int64_t want = u.shard_numel * ItemSize(u.dtype);
      std::shared_ptr<Buffer>& b = out.by_unit[i][chunk.unit()];
      if (b == nullptr) {
        absl::StatusOr<std::shared_ptr<Buffer>> a =
            store_->Allocate(BufferKind::kStaging, want,
                             absl::StrCat("weights shard group=", group, " unit=", u.index,
                                          " rank=", chunk.rank(), " from ", peer),
                             owner_uid);
        if (!a.ok()) {
          status = a.status();
          break;
        }
        b = *std::move(a);
      }
      if (chunk.offset() < 0 || chunk.offset() + static_cast<int64_t>(chunk.data().size()) > want) {
        status = absl::DataLossError(absl::StrCat("a chunk past the end of unit ", u.index,
                                                  "'s shard of rank ", chunk.rank()));
        break;
      }
      std::memcpy(static_cast<char*>(b->data()) + chunk.offset(), chunk.data().data(),
                  chunk.data().size());
      got[i][chunk.unit()] += static_cast<int64_t>(chunk.data().size());
      out.bytes += static_cast<int64_t>(chunk.data().size());
    }
    if (!status.ok()) ctx.TryCancel();
    const grpc::Status finished = reader->Finish();
    if (status.ok() && !finished.ok()) status = FromGrpcStatus(finished);
    if (status.ok() && !header) status = absl::DataLossError("the stream ended before its header");
    for (size_t i = 0; i < out.ranks.size() && status.ok(); ++i) {
      for (const PlanUnit& u : plan.units) {
        const int64_t want = u.shard_numel * ItemSize(u.dtype);
        if (got[i][u.index] != want) {
          status =
              absl::DataLossError(absl::StrCat("rank ", out.ranks[i], " unit ", u.index, ": ",
                                               got[i][u.index], " of ", want, " bytes arrived"));
          break;
        }
      }
    }
  }
  Untrack(&ctx);
  {
    absl::MutexLock lock(&mu_);
    received_ += out.bytes;
  }
  if (!status.ok()) return where(status);
  return out;
}

absl::Status WeightsPeerClient::FetchRange(const std::string& source, const Fetch& f,
                                           int64_t offset, int64_t length, char* dst,
                                           Header* header, Moved* moved, bool ucx,
                                           const UcxWeightsLink::Registration* local) {
  auto stub = v1::WeightsPeerService::NewStub(ChannelTo(source));
  v1::FetchVersionRequest request;
  request.set_name(f.name);
  request.set_owner_uid(f.owner_uid);
  request.set_version(f.version);
  request.set_newer_than(f.newer_than);
  request.set_reader_uid(f.reader_uid);
  request.set_reader_token(f.reader_token);
  request.set_group(f.group);
  request.set_token(f.token);
  request.set_module(f.module);
  request.set_seq(f.seq);
  request.set_wait_ms(std::max<int64_t>(0, absl::ToInt64Milliseconds(f.deadline - absl::Now())));
  request.set_offset(offset);
  request.set_length(length);
  request.set_ucx(ucx && ucx_ != nullptr && dst != nullptr && length > 0);
  grpc::ClientContext ctx;
  const absl::Time asked = absl::Now();
  const absl::Time deadline =
      (f.deadline == absl::InfiniteFuture() ? absl::Now() : f.deadline) + kTransfer;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  if (!Track(&ctx)) return absl::UnavailableError("flatshardd is shutting down");
  absl::Status status;
  int64_t got = 0;
  bool over_ucx = false;
  bool source_alive = false;  // after a UCX get: the stream was still open when it ended
  {
    std::unique_ptr<grpc::ClientReader<v1::VersionChunk>> reader =
        stub->FetchVersion(&ctx, request);
    v1::VersionChunk chunk;
    bool first = true;
    while (reader->Read(&chunk)) {
      if (first) {
        first = false;
        header->meta = MetaOf(chunk);
        header->not_newer = chunk.not_newer();
        continue;
      }
      if (!chunk.ucx_rkey().empty() && request.ucx()) {
        // The source holds the version registered while the stream is open: read the range,
        // then end the call. A stream that ends first (the source died) abandons the get.
        over_ucx = true;
        if (moved != nullptr) {
          moved->source_ready = std::max(moved->source_ready, absl::Now() - asked);
        }
        absl::Notification ended;
        std::thread watch([&] {
          v1::VersionChunk more;
          while (reader->Read(&more)) {
          }
          ended.Notify();
        });
        status = ucx_->Get(chunk.ucx_address(), chunk.ucx_rkey(),
                           chunk.ucx_base() + static_cast<uint64_t>(offset), dst + offset,
                           static_cast<size_t>(length), deadline, &ended,
                           absl::StrCat("daemon ", source), local);
        source_alive = !ended.HasBeenNotified();
        ctx.TryCancel();
        watch.join();
        if (status.ok()) got = length;
        break;
      }
      const int64_t n = static_cast<int64_t>(chunk.data().size());
      if (dst == nullptr || chunk.offset() < offset || chunk.offset() + n > offset + length) {
        status = absl::DataLossError(absl::StrCat("bytes [", chunk.offset(), ", ",
                                                  chunk.offset() + n, ") outside the range asked"));
        ctx.TryCancel();
        break;
      }
      std::memcpy(dst + chunk.offset(), chunk.data().data(), static_cast<size_t>(n));
      got += n;
    }
    const grpc::Status finished = reader->Finish();  // CANCELLED after a UCX read: ours
    if (status.ok() && !finished.ok() && !over_ucx) status = FromGrpcStatus(finished);
    if (status.ok() && first) status = absl::DataLossError("the stream ended before its header");
    if (status.ok() && length > 0 && got != length) {
      status = absl::DataLossError(
          absl::StrCat(got, " of ", length, " bytes arrived (the stream ended early)"));
    }
  }
  Untrack(&ctx);
  if (moved != nullptr && status.ok()) (over_ucx ? moved->ucx : moved->grpc) += got;
  {
    absl::MutexLock lock(&mu_);
    received_ += got;
  }
  if (!status.ok() && over_ucx && source_alive) {
    // The source is there but UCX cannot read from it (no common transport, a firewall):
    // the same range from it in the stream.
    FS_LOG(WARNING) << "copying " << VersionText(f) << " from daemon " << source
                    << " over UCX failed (" << status << "); that range comes over gRPC";
    return FetchRange(source, f, offset, length, dst, header, moved, /*ucx=*/false);
  }
  if (!status.ok() && over_ucx) {
    return absl::Status(status.code(), absl::StrCat("over UCX: ", status.message()));
  }
  return status;
}

absl::StatusOr<std::optional<CopiedVersion>> WeightsPeerClient::FetchVersion(
    const std::vector<std::string>& sources, const Fetch& fetch, Moved* moved) {
  if (sources.empty()) return absl::FailedPreconditionError("no source daemon to copy from");
  const absl::Time asked = absl::Now();
  // The descriptor, from the first source that has it.
  Header header;
  size_t first = sources.size();
  std::vector<std::string> errors;
  for (size_t k = 0; k < sources.size(); ++k) {
    absl::Status s = FetchRange(sources[k], fetch, 0, -1, nullptr, &header, nullptr);
    if (s.ok()) {
      first = k;
      break;
    }
    errors.push_back(absl::StrCat("daemon ", sources[k], ": ", s.message()));
    // A source that answers (NOT_FOUND, PERMISSION_DENIED) decides unless another has it.
    if (k + 1 == sources.size()) {
      return absl::Status(s.code(), absl::StrCat("copying ", VersionText(fetch), ": ",
                                                 absl::StrJoin(errors, "; ")));
    }
  }
  if (header.not_newer) return std::nullopt;
  const absl::Time described = absl::Now();
  CopiedVersion copy = std::move(header.meta);
  const int64_t bytes = copy.layout.bytes;
  std::shared_ptr<Buffer> spare = fetch.spare ? fetch.spare(copy) : nullptr;
  const bool into_spare = spare != nullptr;
  absl::StatusOr<std::shared_ptr<Buffer>> buffer =
      into_spare ? absl::StatusOr<std::shared_ptr<Buffer>>(std::move(spare))
                 : store_->Allocate(BufferKind::kStaging, bytes,
                                    absl::StrCat("weights name=", copy.info.name,
                                                 " version=", copy.info.version, " copied"),
                                    copy.info.owner_uid);
  if (!buffer.ok()) {
    return absl::Status(
        buffer.status().code(),
        absl::StrCat("copying weights \"", copy.info.name, "\" version ", copy.info.version, " (",
                     bytes, " bytes): ", buffer.status().message()));
  }
  copy.buffer = *std::move(buffer);
  char* dst = static_cast<char*>(copy.buffer->data());
  // A fresh buffer's pages are faulted in meanwhile (a spare's are there already).
  std::optional<BackwardPrefault> prefault;
  if (!into_spare) prefault.emplace(dst, bytes);
  // Gets land in registered memory (no registration or bounce buffer per get in UCX).
  std::optional<UcxWeightsLink::Registration> registered;
  if (ucx_ != nullptr && bytes > 0) {
    absl::StatusOr<UcxWeightsLink::Registration> r =
        ucx_->Register(dst, static_cast<size_t>(bytes));
    if (r.ok()) {
      registered = *std::move(r);
    } else {
      FS_LOG(WARNING) << "copying " << VersionText(fetch) << ": " << r.status()
                      << "; the gets register their destinations themselves";
    }
  }
  const UcxWeightsLink::Registration* local = registered ? &*registered : nullptr;
  const absl::Time ready = absl::Now();
  // Every source copies an equal range (from now on: this exact version number).
  Fetch pinned = fetch;
  if (pinned.seq == 0) {
    pinned.version = copy.info.version;
    pinned.newer_than = 0;
  }
  std::vector<std::string> from;
  for (size_t k = first; k < sources.size(); ++k) from.push_back(sources[k]);
  const int64_t n = static_cast<int64_t>(from.size());
  const int64_t step = (bytes / n + 4095) / 4096 * 4096;
  std::vector<absl::Status> results(from.size());
  std::vector<Moved> by_range(from.size());
  std::vector<std::thread> threads;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t lo = std::min(bytes, k * step);
    const int64_t len = k + 1 == n ? bytes - lo : std::min(step, bytes - lo);
    if (len <= 0) continue;
    threads.emplace_back([&, k, lo, len] {
      Header h;
      absl::Status s = FetchRange(from[k], pinned, lo, len, dst, &h, &by_range[k], true, local);
      if (s.ok() && (h.meta.info.version != copy.info.version ||
                     h.meta.info.generation != copy.info.generation)) {
        s = absl::FailedPreconditionError(absl::StrCat(
            "it has version ", h.meta.info.version, " generation ", h.meta.info.generation,
            ", not ", copy.info.version, " generation ", copy.info.generation));
      }
      // A source that failed mid-copy: its range again from each other source in turn.
      for (int64_t j = 0; !s.ok() && j < n; ++j) {
        if (j == k || s.code() == absl::StatusCode::kCancelled) continue;
        FS_LOG(WARNING) << "copying weights \"" << copy.info.name << "\" version "
                        << copy.info.version << " from " << from[k] << " failed (" << s
                        << "); that range comes from " << from[j];
        s = FetchRange(from[j], pinned, lo, len, dst, &h, &by_range[k], true, local);
      }
      results[k] =
          s.ok() ? s : absl::Status(s.code(), absl::StrCat("daemon ", from[k], ": ", s.message()));
    });
  }
  for (auto& t : threads) t.join();
  if (prefault) prefault->Stop();
  registered.reset();  // before the buffer goes anywhere (sealed, freed)
  Moved all;
  all.into_spare = into_spare;
  all.descriptor = described - asked;
  all.destination = ready - described;
  all.transfer = absl::Now() - ready;
  for (const Moved& m : by_range) {
    all.ucx += m.ucx;
    all.grpc += m.grpc;
    all.source_ready = std::max(all.source_ready, m.source_ready);
  }
  if (moved != nullptr) {
    const int64_t ucx = moved->ucx + all.ucx, grpc = moved->grpc + all.grpc;
    *moved = all;
    moved->ucx = ucx;
    moved->grpc = grpc;
  }
  for (const absl::Status& s : results) {
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("copying weights \"", copy.info.name, "\" version ",
                                 copy.info.version, ": ", s.message(), " (nothing was kept)"));
    }
  }
  if (all.ucx > 0) CopiedBytes().WithLabels({"ucx"}).Increment(static_cast<double>(all.ucx));
  if (all.grpc > 0) CopiedBytes().WithLabels({"grpc"}).Increment(static_cast<double>(all.grpc));
  return copy;
}

absl::Status WeightsPeerClient::WatchVersions(
    const std::string& source, const Watch& watch,
    absl::FunctionRef<void(uint64_t version)> on_version,
    absl::FunctionRef<bool(grpc::ClientContext*)> attach) {
  auto stub = v1::WeightsPeerService::NewStub(ChannelTo(source));
  v1::WatchVersionsRequest request;
  request.set_name(watch.name);
  request.set_owner_uid(watch.owner_uid);
  request.set_after(watch.after);
  request.set_reader_uid(watch.reader_uid);
  request.set_reader_token(watch.reader_token);
  request.set_wait_ms(absl::ToInt64Milliseconds(watch.wait));
  grpc::ClientContext ctx;
  // The source ends the stream at watch.wait; a source that hangs past it is given up on.
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + watch.wait + absl::Seconds(10)));
  if (!attach(&ctx)) return absl::CancelledError("no longer followed");
  absl::Status status;
  if (!Track(&ctx)) {
    status = absl::UnavailableError("flatshardd is shutting down");
  } else {
    std::unique_ptr<grpc::ClientReader<v1::PublishedVersion>> reader =
        stub->WatchVersions(&ctx, request);
    v1::PublishedVersion v;
    while (reader->Read(&v)) on_version(v.version());  // the first: 0
    status = FromGrpcStatus(reader->Finish());
    Untrack(&ctx);
  }
  attach(nullptr);
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("watching weights \"", watch.name, "\" of uid ", watch.owner_uid,
                                   " at daemon ", source, ": ", status.message()));
}

}  // namespace flatshard::server
