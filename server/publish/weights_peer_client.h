#pragma once
// WeightsPeerClient: this daemon's side of WeightsPeerService (weights_peer.proto) on other
// daemons' peer ports: reads another daemon's committed shards of a publish (the leader of a
// multi-daemon group) and copies whole versions (the leader's other daemons; a reader's daemon
// pulling from --weights_sources). Received bytes go straight into buffers of the store
// (kStaging, allocated for the version's owner uid: its quota and the daemon's limit count
// them); a stream that fails or ends early frees them, so nothing partial is ever kept.
//
// Thread-safe. One leaf lock (the channels and the calls in flight), never held across a call.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "server/publish/publisher.h"
#include "server/publish/ucx_weights_link.h"

namespace grpc {
class Channel;
class ChannelCredentials;
class ClientContext;
}  // namespace grpc

namespace flatshard::server {

class ShardStore;
class UcxWeightsLink;

class WeightsPeerClient {
 public:
  // `credentials`: how this daemon reaches the others' peer ports (null: insecure). `ucx`
  // (null: none): versions are copied with UCX gets where the source offers them
  // (--weights_transport=ucx), else over the gRPC stream. Must outlive this.
  WeightsPeerClient(std::shared_ptr<grpc::ChannelCredentials> credentials, ShardStore* store,
                    UcxWeightsLink* ucx = nullptr);
  ~WeightsPeerClient();

  // Another daemon's ranks' committed shards of publish `seq`.
  struct Shards {
    uint64_t generation = 0;
    std::vector<int32_t> ranks;
    // By position in `ranks`, by plan unit: shard_numel elements of the unit's dtype.
    std::vector<std::vector<std::shared_ptr<Buffer>>> by_unit;
    int64_t bytes = 0;
  };
  absl::StatusOr<Shards> ReadShards(const std::string& peer, const Plan& plan, int64_t owner_uid,
                                    const std::string& group, const std::string& token,
                                    const std::string& module, uint64_t seq, absl::Time deadline);

  // Which version to copy: by (owner uid, name, number) for a reader, or the one a publish
  // built (group, token, module, seq).
  struct Fetch {
    std::string name;
    int64_t owner_uid = -1;
    uint64_t version = 0;     // 0: the newest
    uint64_t newer_than = 0;  // > 0: nothing (nullopt) unless the newest is newer than it
    int64_t reader_uid = -1;
    std::string reader_token;
    std::string group;
    std::string token;
    std::string module;
    uint64_t seq = 0;
    absl::Time deadline = absl::InfiniteFuture();  // the source's wait for the version
    // The copy's destination when it has one (the name's spare segment: memory already
    // written, no page to fault in); null or returning null: a fresh buffer.
    std::function<std::shared_ptr<Buffer>(const CopiedVersion&)> spare;
  };
  // Copies the version from `sources` (tried in order for the descriptor; with several, each
  // from the first that answered on copies an equal byte range in parallel, a failed range
  // coming from the others in turn). nullopt: not newer than fetch.newer_than. Errors name the
  // source and the version: its own (NOT_FOUND, PERMISSION_DENIED) or UNAVAILABLE/DATA_LOSS for a
  // source that went away mid-copy; RESOURCE_EXHAUSTED from the store.
  // `moved` (optional): the bytes that came over each transport ("ucx", "grpc"), so a
  // source that fell back shows.
  struct Moved {
    int64_t ucx = 0;
    int64_t grpc = 0;
    bool into_spare = false;  // the bytes went into fetch.spare's buffer
    // Where the time went (logged): the descriptor's round trip; the destination (allocated
    // or the spare, registered with UCX); the longest wait of a range for its source's
    // registration (rkey); the bytes (every range asked until the last arrived).
    absl::Duration descriptor, destination, source_ready, transfer;
  };
  absl::StatusOr<std::optional<CopiedVersion>> FetchVersion(const std::vector<std::string>& sources,
                                                            const Fetch& fetch,
                                                            Moved* moved = nullptr);
  // "ucx" when this client asks for UCX gets, else "grpc".
  const char* transport() const { return ucx_ != nullptr ? "ucx" : "grpc"; }

  // Which name to hear of (WatchVersions): versions newer than `after` that the reader may
  // open.
  struct Watch {
    std::string name;
    int64_t owner_uid = -1;
    uint64_t after = 0;
    int64_t reader_uid = -1;
    std::string reader_token;
    absl::Duration wait = absl::Seconds(30);  // the source ends the stream after this
  };
  // Streams `source`'s new versions of watch.name into `on_version` (on this thread, in
  // order; first 0 once the source registered the watch) until the source ends the stream (OK,
  // after watch.wait) or it fails (the source's error, UNAVAILABLE for a source that is gone;
  // CANCELLED), naming the source. `attach` gets the call's context before the call (false: not
  // started, CANCELLED) and null before the context goes, so its owner may TryCancel it meanwhile.
  absl::Status WatchVersions(const std::string& source, const Watch& watch,
                             absl::FunctionRef<void(uint64_t version)> on_version,
                             absl::FunctionRef<bool(grpc::ClientContext*)> attach);

  // Bytes received into versions and shards so far (for tests and metrics).
  int64_t bytes_received() const;

  // Cancels the calls in flight (they fail UNAVAILABLE); later calls fail at once.
  void Shutdown();

 private:
  // A stream's first message: the version without its bytes.
  struct Header {
    CopiedVersion meta;  // no buffer
    bool not_newer = false;
  };
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& peer);
  // Registers a call for Shutdown; false once shut down.
  bool Track(grpc::ClientContext* ctx);
  void Untrack(grpc::ClientContext* ctx);
  // One FetchVersion stream: the descriptor into `*header` and the bytes of [offset, offset +
  // length) of the segment into dst + offset (length -1, dst null: the descriptor only), over
  // UCX where `ucx` and the source offers it (a get that fails while the source's stream is
  // still open: that range again in the stream); the bytes moved are added to `*moved`.
  // `local` (optional): dst's UCX registration.
  absl::Status FetchRange(const std::string& source, const Fetch& fetch, int64_t offset,
                          int64_t length, char* dst, Header* header, Moved* moved, bool ucx = true,
                          const UcxWeightsLink::Registration* local = nullptr);

  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  ShardStore* const store_;
  UcxWeightsLink* const ucx_;
  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatshard::server
