#include "server/publish/weights_puller.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/metrics/registry.h"
#include "server/publish/weights_peer_client.h"

namespace flatshard::server {
namespace {

struct PullMetrics {
  metrics::CounterFamily& pulls;
  metrics::CounterFamily& bytes;
};

const PullMetrics& Metrics() {
  static const PullMetrics* m = [] {
    metrics::Registry& r = metrics::DefaultRegistry();
    return new PullMetrics{
        r.AddCounter("flatshard_weights_pulls_total",
                     "Versions of weights copied from --weights_sources, by result", {"code"}),
        r.AddCounter("flatshard_weights_pulled_bytes_total",
                     "Bytes of versions of weights copied from --weights_sources, by transport "
                     "(ucx: UCX gets, grpc: the FetchVersion stream)",
                     {"transport"})};
  }();
  return *m;
}

}  // namespace

WeightsPuller::WeightsPuller(Publisher* publisher, WeightsPeerClient* client,
                             std::vector<std::string> sources, FollowerOptions follow)
    : publisher_(publisher),
      client_(client),
      sources_(sources),
      follower_(publisher, this, client, std::move(sources), follow) {
  Metrics();  // every family shows (at 0) from the first scrape
}

absl::Status WeightsPuller::ValidateSources(const std::vector<std::string>& sources) {
  for (const std::string& s : sources) {
    const size_t colon = s.rfind(':');
    if (s.empty() || colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--weights_sources: \"", s,
                       "\" is not a peer address (host:port of a daemon's "
                       "--peer_address)"));
    }
  }
  return absl::OkStatus();
}

absl::Status WeightsPuller::Refresh(const WeightsSelector& selector, int64_t uid,
                                    bool local_fallback) {
  const int64_t owner = selector.owner_uid == -2 ? uid : selector.owner_uid;
  const Key key{owner, selector.name};
  std::shared_ptr<Flight> flight;
  bool lead = false;
  // A version asked by number that is here already: nothing to copy.
  if (selector.version != 0) {
    WeightsSelector s = selector;
    s.owner_uid = owner;
    if (publisher_->Inspect(s, uid).ok()) return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Flight>& f = flights_[key];
    if (f == nullptr) {
      f = std::make_shared<Flight>();
      lead = true;
    }
    flight = f;
    if (!lead) {
      // One copy per name at a time: this reader maps what it brings.
      mu_.Await(absl::Condition(
          +[](Flight* x) { return x->done; }, flight.get()));
      return flight->status.ok() || !local_fallback || publisher_->Newest(owner, selector.name) == 0
                 ? flight->status
                 : absl::OkStatus();
    }
  }
  absl::Status s = Copy(selector, owner, uid);
  if (!s.ok() && local_fallback && selector.version == 0 &&
      publisher_->Newest(owner, selector.name) > 0) {
    FS_LOG(WARNING) << "weights \"" << selector.name << "\": " << s
                    << "; readers open the newest local copy";
    s = absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    flight->done = true;
    flight->status = s;
    flights_.erase(key);
  }
  return s;
}

void WeightsPuller::RefreshAsync(WeightsSelector selector, int64_t uid,
                                 absl::AnyInvocable<void(absl::Status)> done) {
  std::vector<std::thread> reap;  // threads that ended: joined here, off the lock
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : finished_) {
      if (auto it = threads_.find(id); it != threads_.end()) {
        reap.push_back(std::move(it->second));
        threads_.erase(it);
      }
    }
    finished_.clear();
    if (!stopped_) {
      const uint64_t id = next_thread_++;
      threads_[id] = std::thread([this, id, selector = std::move(selector), uid,
                                  done = std::move(done)]() mutable {
        done(Refresh(selector, uid));
        // After the reader is answered: the newest copy survives a restart (file I/O).
        publisher_->StoreNewest(selector.owner_uid == -2 ? uid : selector.owner_uid, selector.name);
        absl::MutexLock lock(&mu_);
        finished_.push_back(id);
      });
      done = nullptr;
    }
  }
  for (std::thread& t : reap) t.join();
  if (done) done(absl::UnavailableError("flatshardd is shutting down"));
}

void WeightsPuller::Shutdown() {
  follower_.Shutdown();
  std::map<uint64_t, std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    threads.swap(threads_);
    finished_.clear();
  }
  for (auto& [id, t] : threads) t.join();
}

absl::Status WeightsPuller::Copy(const WeightsSelector& selector, int64_t owner, int64_t uid) {
  WeightsPeerClient::Fetch f;
  f.name = selector.name;
  f.owner_uid = owner;
  f.version = selector.version;
  f.newer_than = selector.version == 0 ? publisher_->Newest(owner, selector.name) : 0;
  f.reader_uid = uid;
  f.reader_token = selector.token;
  f.deadline = absl::Now();  // versions by name: no waiting at the source
  f.spare = [this](const CopiedVersion& c) { return publisher_->TakeSpare(c); };
  const absl::Time start = absl::Now();
  WeightsPeerClient::Moved moved;
  absl::StatusOr<std::optional<CopiedVersion>> copy = client_->FetchVersion(sources_, f, &moved);
  if (copy.ok() && !copy->has_value()) return absl::OkStatus();  // nothing newer
  absl::StatusOr<WeightsInfo> added =
      copy.ok() ? publisher_->AddCopy(**std::move(copy)) : copy.status();
  Metrics().pulls.WithLabels({absl::StatusCodeToString(added.status().code())}).Increment();
  if (!added.ok()) return added.status();
  if (moved.ucx > 0) Metrics().bytes.WithLabels({"ucx"}).Increment(static_cast<double>(moved.ucx));
  if (moved.grpc > 0) {
    Metrics().bytes.WithLabels({"grpc"}).Increment(static_cast<double>(moved.grpc));
  }
  FS_LOG(INFO) << "copied weights \"" << added->name << "\" version " << added->version
               << " generation " << added->generation << " of uid " << added->owner_uid << " ("
               << added->bytes << " bytes: " << moved.ucx << " over UCX, " << moved.grpc
               << " over gRPC" << (moved.into_spare ? ", into the name's spare segment" : "")
               << ") from --weights_sources in " << absl::ToDoubleMilliseconds(absl::Now() - start)
               << " ms (descriptor " << absl::ToDoubleMilliseconds(moved.descriptor)
               << " ms, destination " << absl::ToDoubleMilliseconds(moved.destination)
               << " ms, bytes " << absl::ToDoubleMilliseconds(moved.transfer)
               << " ms, of which waiting for "
               << "the sources' UCX registration " << absl::ToDoubleMilliseconds(moved.source_ready)
               << " ms)";
  return absl::OkStatus();
}

}  // namespace flatshard::server
