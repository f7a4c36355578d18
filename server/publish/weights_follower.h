#pragma once
// WeightsFollower: a reader's daemon with --weights_sources follows the names its local
// readers watch (README "Readers on other nodes"), so a local WaitForVersion / watch returns
// each new version already copied here, without an Open of `latest` asking for it.
//
// Design: while at least one local watch of (owner uid, name) is open, one thread of the
// follower holds a WatchVersions stream (weights_peer.proto) to one source, asking for
// versions newer than the newest local one; each version it hears of that is newer than the
// local newest is copied through the puller (WeightsPuller::Refresh: one copy per version,
// shared with readers opening it meanwhile, the bytes from every source) and then stored in
// the state directory (Publisher::StoreNewest). The source ends the stream after
// `FollowerOptions::wait` and the thread asks again; a stream that fails (a source that died
// or went away) or a copy that fails is logged, and the thread tries the next source after a
// backoff (doubling up to `max_backoff`), round the list, for as long as the name is watched:
// a source that restarts is followed again, and versions published meanwhile come at once
// (the newest one; older ones are skipped). The stream and copies run as the uid (and with
// the reader token) of the local watch that started following, so the sources only tell of
// versions that reader may open (and never of versions in a source's GPU memory: those are
// not copied between daemons). The last local watch ending cancels the stream.
//
// Thread-safe. One leaf lock, never held across a call or a copy.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/publish/publisher.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace flatshard::server {

class WeightsPeerClient;
class WeightsPuller;

struct FollowerOptions {
  absl::Duration wait = absl::Seconds(30);  // a WatchVersions stream's length at the source
  absl::Duration min_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
};

class WeightsFollower {
 public:
  // Pointers must outlive this.
  WeightsFollower(Publisher* publisher, WeightsPuller* puller, WeightsPeerClient* client,
                  std::vector<std::string> sources, FollowerOptions options = {});
  ~WeightsFollower() { Shutdown(); }

  // A local watch of `selector` (its owner_uid -2: `uid`'s own) by reader `uid` opened:
  // follows the name while any such watch is open. Returns the handle for Unfollow (0 after
  // Shutdown). Never blocks on the network.
  uint64_t Follow(const WeightsSelector& selector, int64_t uid);
  // That watch ended. Idempotent; 0 is ignored. Never blocks on the network.
  void Unfollow(uint64_t handle);
  // Cancels the streams and joins the threads (copies in flight end when the peer client is
  // shut down). Idempotent.
  void Shutdown();

 private:
  using Key = std::pair<int64_t, std::string>;  // (owner uid, name)
  struct Entry {
    int refs = 0;  // open local watches
    int64_t uid = -1;
    std::string token;
    uint64_t thread = 0;
    grpc::ClientContext* call = nullptr;  // the stream now, for cancelling it
  };
  void Loop(const Key& key, const std::shared_ptr<Entry>& e);
  // Copies `version` (heard from a source) unless a newer one is here already; the copy's
  // error otherwise (also when a copy left no newer version here).
  absl::Status Pull(const Key& key, const Entry& e, uint64_t version);

  Publisher* const publisher_;
  WeightsPuller* const puller_;
  WeightsPeerClient* const client_;
  const std::vector<std::string> sources_;
  const FollowerOptions options_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<Key, std::shared_ptr<Entry>> follows_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Key> handles_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);  // threads to join
};

}  // namespace flatshard::server
