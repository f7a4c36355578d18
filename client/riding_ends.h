#pragma once
// The summons a Summon ends in its own RPC (Client::Summon's end_first, SummonRequest.end_first):
// one round trip per unit transition. RidingEnds takes them from the caller, drops their views,
// names them in the request, and ends them on their own when the Summon never got to.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.pb.h"

namespace flatshard::client::internal {

class RidingEnds {
 public:
  // A plain EndSummon of a read-only summon (the client's).
  using EndFn = std::function<absl::Status(uint64_t session, const std::string& module,
                                           uint64_t summon, int device)>;

  // Takes `previous`: a read-only summon for which `rides` holds (one of this Client's
  // current session) has its views dropped and rides, up to kMaxEndFirst (the daemon's
  // bound; the rest are ended by `end`). The others are ended now by their own End(): a
  // writeback one's error is returned (after every one was taken), another's only logged.
  absl::Status Take(SummonedList previous, const std::function<bool(const SummonedParams&)>& rides,
                    const EndFn& end);

  bool empty() const { return riding_.empty(); }
  // The GPU of the first riding summon with device views; -1 when none has any.
  int device() const;
  // Names the riding summons in `request`.
  void AddTo(v1::SummonRequest* request) const;
  // Ends each riding summon with `end` (the Summon failed, or never was sent). NOT_FOUND
  // means the daemon (or the session's end) already did; other errors are logged.
  void EndEach(const EndFn& end) const;

 private:
  struct Riding {
    uint64_t session = 0;
    std::string module;
    uint64_t id = 0;
    int device = -1;
  };
  static void EndOne(const Riding& r, const EndFn& end);

  std::vector<Riding> riding_;
};

}  // namespace flatshard::client::internal
