#include "server/publish/weights_follower.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/client_context.h"
#include "server/metrics/registry.h"
#include "server/publish/weights_peer_client.h"
#include "server/publish/weights_puller.h"

namespace flatshard::server {
namespace {

metrics::GaugeFamily& FollowedGauge() {
  static metrics::GaugeFamily& g = metrics::DefaultRegistry().AddGauge(
      "flatshard_weights_followed",
      "Names of weights this daemon follows at its --weights_sources (watched by a local reader)");
  return g;
}

metrics::GaugeFamily& StreamsGauge() {
  static metrics::GaugeFamily& g = metrics::DefaultRegistry().AddGauge(
      "flatshard_weights_follow_streams",
      "WatchVersions streams open at --weights_sources (the source registered the watch)");
  return g;
}

}  // namespace

WeightsFollower::WeightsFollower(Publisher* publisher, WeightsPuller* puller,
                                 WeightsPeerClient* client, std::vector<std::string> sources,
                                 FollowerOptions options)
    : publisher_(publisher),
      puller_(puller),
      client_(client),
      sources_(std::move(sources)),
      options_(options) {
  FollowedGauge().WithLabels({}).Set(0);  // shows from the first scrape
  StreamsGauge().WithLabels({}).Set(0);
}

uint64_t WeightsFollower::Follow(const WeightsSelector& selector, int64_t uid) {
  const Key key{selector.owner_uid == -2 ? uid : selector.owner_uid, selector.name};
  std::vector<std::thread> reap;  // threads that ended: joined here, off the lock
  uint64_t handle = 0;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : finished_) {
      if (auto it = threads_.find(id); it != threads_.end()) {
        reap.push_back(std::move(it->second));
        threads_.erase(it);
      }
    }
    finished_.clear();
    if (!stopped_ && !sources_.empty()) {
      handle = next_id_++;
      handles_[handle] = key;
      std::shared_ptr<Entry>& e = follows_[key];
      if (e == nullptr) {
        e = std::make_shared<Entry>();
        e->uid = uid;
        e->token = selector.token;
        e->thread = handle;
        threads_[handle] = std::thread([this, key, e] { Loop(key, e); });
        FollowedGauge().WithLabels({}).Set(static_cast<double>(follows_.size()));
      }
      ++e->refs;
    }
  }
  for (std::thread& t : reap) t.join();
  return handle;
}

void WeightsFollower::Unfollow(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  auto h = handles_.find(handle);
  if (h == handles_.end()) return;
  auto it = follows_.find(h->second);
  handles_.erase(h);
  if (it == follows_.end()) return;
  Entry& e = *it->second;
  // The last watch: the stream ends now (the thread then sees no reference and leaves).
  if (--e.refs == 0 && e.call != nullptr) e.call->TryCancel();
}

void WeightsFollower::Shutdown() {
  std::map<uint64_t, std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    for (auto& [key, e] : follows_) {
      if (e->call != nullptr) e->call->TryCancel();
    }
    threads.swap(threads_);
    finished_.clear();
  }
  for (auto& [id, t] : threads) t.join();
}

absl::Status WeightsFollower::Pull(const Key& key, const Entry& e, uint64_t version) {
  if (version <= publisher_->Newest(key.first, key.second)) return absl::OkStatus();
  absl::Status s = puller_->Refresh(WeightsSelector{key.second, key.first, 0, e.token}, e.uid,
                                    /*local_fallback=*/false);
  // A copy an Open led may have fallen back on the local one: a follower tries again.
  if (s.ok() && publisher_->Newest(key.first, key.second) < version) {
    s = absl::UnavailableError(absl::StrCat("version ", version, " was not copied"));
  }
  if (s.ok()) publisher_->StoreNewest(key.first, key.second);
  return s;
}

void WeightsFollower::Loop(const Key& key, const std::shared_ptr<Entry>& e) {
  const auto followed = [&]()
                            ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !stopped_ && e->refs > 0; };
  size_t at = 0;  // the source asked now
  absl::Duration backoff = options_.min_backoff;
  std::string last_error;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (!followed()) {
        if (auto it = follows_.find(key); it != follows_.end() && it->second == e) {
          follows_.erase(it);
        }
        FollowedGauge().WithLabels({}).Set(static_cast<double>(follows_.size()));
        finished_.push_back(e->thread);
        return;
      }
    }
    const std::string& source = sources_[at % sources_.size()];
    WeightsPeerClient::Watch w{key.second, key.first, publisher_->Newest(key.first, key.second),
                               e->uid,     e->token,  options_.wait};
    absl::Status pulled;
    bool open = false;
    absl::Status s = client_->WatchVersions(
        source, w,
        [&](uint64_t version) {
          if (version == 0) {
            open = true;
            StreamsGauge().WithLabels({}).Add(1);
            return;
          }
          if (!pulled.ok()) return;
          pulled = Pull(key, *e, version);
          if (pulled.ok()) return;
          absl::MutexLock lock(&mu_);  // back off, then ask again (for the newest)
          if (e->call != nullptr) e->call->TryCancel();
        },
        [&](grpc::ClientContext* call) {
          absl::MutexLock lock(&mu_);
          if (call != nullptr && !followed()) return false;
          e->call = call;
          return true;
        });
    if (open) StreamsGauge().WithLabels({}).Add(-1);
    if (open && pulled.ok()) {  // the source answered: a failure now is a new one
      backoff = options_.min_backoff;
      last_error.clear();
    }
    if (!pulled.ok()) s = pulled;
    if (s.ok() || (s.code() == absl::StatusCode::kCancelled && pulled.ok())) {
      backoff = options_.min_backoff;  // the stream's wait ended, or no local watch is left
      continue;
    }
    if (s.ToString() != last_error) {  // not once per retry of the same failure
      last_error = s.ToString();
      FS_LOG(WARNING) << "following weights \"" << key.second << "\" of uid " << key.first << ": "
                      << s << "; trying again in " << backoff
                      << (sources_.size() > 1 ? " at the next source" : "");
    }
    ++at;
    absl::MutexLock lock(&mu_);
    const auto over = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !followed(); };
    mu_.AwaitWithTimeout(absl::Condition(&over), backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace flatshard::server
