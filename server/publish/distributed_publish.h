#pragma once
// DistributedPublish: publishing weights from a group whose ranks join through several
// daemons (README "Published weights across daemons").
//
// Design: every daemon's Publisher batches its own ranks' arrivals (PublishRounds numbers
// the batches). The daemon of rank 0 (the leader) builds the version of its publish `seq`: it
// holds its own committed copies, reads every other daemon's (ReadShards: each pairs `seq`
// with its oldest batch the leader has not read, waiting for its ranks to arrive, and holds
// its copies still while it sends them), checks that all hold the same generation and fills
// one segment, as a single-daemon publish does; then it numbers and inserts it. Every other
// daemon, once its batch is paired, copies the version the leader built for that `seq`
// (FetchVersion, waiting for the leader) into a segment of its own, seals it and inserts it
// under the leader's number and generation. So each daemon's shards cross the network once
// to the leader and the whole version once to each other daemon; a version appears on a
// daemon only complete; a publish that fails (a rank that never arrives, a daemon or
// publisher killed mid-way) leaves nothing on the daemons it did not finish on, and the
// ranks on every daemon get the leader's error.
//
// Thread-safe.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/checkpoint/checkpoints.h"
#include "server/publish/publish_rounds.h"
#include "server/publish/publisher.h"
#include "server/publish/weights_peer_client.h"

namespace flatshard::server {

class DistributedPublish {
 public:
  // `client` must outlive this.
  explicit DistributedPublish(WeightsPeerClient* client) : client_(client) {}

  PublishRounds& rounds() { return rounds_; }
  WeightsPeerClient& client() { return *client_; }

  // The leader, holding its copies `c`: appends every other daemon's ranks and their shards
  // of publish `seq` to `ranks` and `by_unit` (read in parallel). ABORTED when a daemon held
  // another generation than c.generation (naming it and both generations); the daemon's
  // error otherwise.
  absl::Status GatherShards(const CommittedCopies& c, uint64_t seq, absl::Time deadline,
                            std::vector<int32_t>* ranks,
                            std::vector<std::vector<std::shared_ptr<Buffer>>>* by_unit);

  // Another daemon, for its batch number `seq` (PublishRounds::Arrived): waits until the
  // leader read this daemon's shards for one of its publishes, then copies the version of
  // (owner_uid, name) the leader built for it (its error when it failed; UNAVAILABLE naming
  // the leader when that daemon is gone; DEADLINE_EXCEEDED when the leader never read).
  struct LeaderVersion {
    std::string leader;
    std::string group;
    std::string token;
    std::string module;
    uint64_t seq = 0;
    std::string name;
    int64_t owner_uid = -1;
    absl::Time deadline;
    // Where the bytes may land (WeightsPeerClient::Fetch::spare); null: a fresh buffer.
    std::function<std::shared_ptr<Buffer>(const CopiedVersion&)> spare;
  };
  absl::StatusOr<CopiedVersion> FetchFromLeader(const LeaderVersion& which);

  // Wakes waiters and cancels copies in flight.
  void Shutdown();

 private:
  WeightsPeerClient* const client_;
  PublishRounds rounds_;
};

}  // namespace flatshard::server
