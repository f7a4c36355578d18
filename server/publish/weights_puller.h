#pragma once
// WeightsPuller: a reader's daemon that holds no shard of the publishing group copies
// versions from the group's daemons (--weights_sources, their peer addresses; README
// "Published weights across daemons").
//
// Design: pull on demand. A reader opening (or inspecting) a name asks this daemon; for
// `latest`, or a version this daemon lacks, the puller asks the sources for a newer (or that)
// version and copies it once into a sealed local version with the source's number and
// generation (WeightsPeerClient::FetchVersion: several sources each send a share of the
// bytes). Readers asking at the same time wait for the one copy in flight for their name;
// every reader then maps the local copy. The source checks the reader's uid (or token) before
// any byte moves. When the sources cannot be reached and a local copy exists, `latest` opens
// the local one (logged); without one the reader gets the named error. A failed copy leaves
// nothing; the next reader's open tries again.
//
// Following (weights_follower.h): names that local readers watch are copied as the sources
// publish them, without an Open asking. Restarts: after a copy, the newest copy of the name is
// written to the state directory (Publisher::StoreNewest; off the reader's path: its Open is
// answered first), so a restarted daemon serves it without copying again.
//
// Thread-safe. One leaf lock (the copies in flight), never held across a copy.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/publish/publisher.h"
#include "server/publish/weights_follower.h"

namespace flatshard::server {

class WeightsPeerClient;

class WeightsPuller {
 public:
  // `sources`: peer addresses ("host:port") of daemons that hold the versions. Pointers must
  // outlive this.
  WeightsPuller(Publisher* publisher, WeightsPeerClient* client, std::vector<std::string> sources,
                FollowerOptions follow = {});

  // "--weights_sources: ..." for a malformed address; OK otherwise.
  static absl::Status ValidateSources(const std::vector<std::string>& sources);

  // Makes the version `selector` names (for reader `uid`) local when a source has it newer
  // than this daemon's (latest) or this daemon lacks it; blocks while the copy runs. OK
  // when there is nothing to copy or a local copy serves (`latest` only, and only with
  // `local_fallback`); the copy's error otherwise (naming the sources and the version).
  absl::Status Refresh(const WeightsSelector& selector, int64_t uid, bool local_fallback = true);
  // Refresh on a thread of the puller's (never a gRPC reactor's); `done` runs there.
  // After Shutdown, `done` gets UNAVAILABLE at once.
  void RefreshAsync(WeightsSelector selector, int64_t uid,
                    absl::AnyInvocable<void(absl::Status)> done);
  // Local watches follow their names at the sources (weights_follower.h).
  WeightsFollower* follower() { return &follower_; }
  // Stops following, joins the threads (copies in flight end when the client is shut down).
  // Idempotent.
  void Shutdown();
  ~WeightsPuller() { Shutdown(); }

 private:
  struct Flight {
    bool done = false;
    absl::Status status;
  };
  using Key = std::pair<int64_t, std::string>;  // (owner uid, name)
  absl::Status Copy(const WeightsSelector& selector, int64_t owner, int64_t uid);

  Publisher* const publisher_;
  WeightsPeerClient* const client_;
  const std::vector<std::string> sources_;
  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<Flight>> flights_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_thread_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);  // threads to join
  WeightsFollower follower_;                             // last: its threads call Refresh
};

}  // namespace flatshard::server
