#pragma once
// Helpers the daemon core's owners share (server/group/, server/module/, server/durable/,
// server/checkpoint/): message texts, the agreement record, the held-module keys of a
// rendezvous. Not for other users.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/limits.h"
#include "common/logging.h"
#include "server/group_manager.h"

namespace flatshard::server {
namespace internal {

// The registered modules of a group as daemons report them at rendezvous: "path\x1fplan
// fingerprint" (peer_service.proto RendezvousRequest.registered_modules).
// `lost` (optional): the modules this daemon dropped as lost and still reports to its ranks.
// They are reported as held under the fingerprint "lost", which no plan has, so a daemon that
// restarted without them (it holds nothing) learns of the loss from the next table too, even
// when this daemon dropped them before its rank's rendezvous (a survivor re-joining after the
// re-form), and tells its own ranks.
//
// Restarts: each held module also carries its committed generation, "path\x1ffingerprint
// \x1fgeneration" (HeldKey), so that daemons whose ranks hold different generations of a module
// (one was killed between the daemons' copies of one commit) find out at the re-form: every
// daemon drops it as lost, naming which daemon held which generation (ReconcileModules). The
// generation a daemon reports is the highest its local ranks hold or are committing to (a
// commit whose copies are still under way completes whatever the trainers do).
template <typename R>
uint64_t HeldGeneration(const R& reg) {
  uint64_t g = 0;
  for (uint64_t x : reg.generation) g = std::max(g, x);
  if (reg.pending_commit.has_value()) g = std::max(g, reg.pending_commit->generation);
  return g;
}
// The generations of the ranks of `reg` held here (those with shards) when they differ and
// no commit's copies are under way: "rank 0: generation 2, rank 1: generation 1"; empty when
// they agree. Such a module is a mix (a commit reached some local ranks only) and is never
// handed out: it is dropped as lost at the next re-form (ReconcileModules, HeldKey).
template <typename R>
std::string MixedGenerations(const R& reg) {
  if (!reg.initialized) return "";
  std::vector<std::string> parts;
  bool mixed = false;
  uint64_t first = 0;
  bool any = false;
  for (size_t r = 0; r < reg.generation.size() && r < reg.shards_by_rank.size(); ++r) {
    if (reg.shards_by_rank[r].empty()) continue;
    // A rank whose shards hold a commit under way (ready) counts at that generation: its
    // copy completes whatever happens (a restart finishes it from the shards).
    uint64_t gen = reg.generation[r];
    bool committing = false;
    if (reg.pending_commit.has_value()) {
      const auto& ready = reg.pending_commit->ready_ranks;
      if (std::find(ready.begin(), ready.end(), static_cast<int32_t>(r)) != ready.end() &&
          reg.pending_commit->generation > gen) {
        gen = reg.pending_commit->generation;
        committing = true;
      }
    }
    if (any && gen != first) mixed = true;
    if (!any) first = gen;
    any = true;
    parts.push_back(
        absl::StrCat("rank ", r, ": generation ", gen, committing ? " (committing)" : ""));
  }
  return mixed ? absl::StrJoin(parts, ", ") : std::string();
}
// A module whose local ranks hold different generations is reported under the generation
// "mixed (rank 0: generation 2, ...)", which no other daemon holds, so every daemon of the
// group drops it as lost and names each rank's generation (ReconcileModules).
template <typename R>
std::string HeldKey(const std::string& module, const R& reg) {
  const std::string mixed = MixedGenerations(reg);
  if (!mixed.empty()) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1fmixed (", mixed, ")");
  }
  return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", HeldGeneration(reg));
}
template <typename M>
std::vector<std::string> HeldModules(const M& registered,
                                     const std::map<std::string, std::string>* lost = nullptr) {
  std::vector<std::string> out;
  for (const auto& [module, reg] : registered) out.push_back(HeldKey(module, reg));
  if (lost != nullptr) {
    for (const auto& [module, why] : *lost) {
      if (!registered.contains(module)) out.push_back(absl::StrCat(module, "\x1flost"));
    }
  }
  return out;
}

// "ranks 1, 2, 5" or "ranks 1, 2, ... (1048575 ranks)": at most `limit` of them named, so a
// message about a huge group stays small.
inline std::string RankListText(const std::vector<int32_t>& ranks, size_t limit = 16) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < limit; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > limit) absl::StrAppend(&out, ", ... (", ranks.size(), " ranks)");
  return out;
}

// At most 64 characters of a caller-given name, for messages.
inline std::string Short(const std::string& name) {
  return name.size() <= 64 ? name : absl::StrCat(name.substr(0, 61), "...");
}

// Token comparison that takes the same time wherever the first difference is.
inline bool TokensEqual(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// Access control (README "Access control"): a group answers only callers of the uid that
// created it; remote (TCP) callers have uid -1 and share the groups created over TCP.
template <typename G>
inline absl::Status CheckUid(const G& g, int64_t uid) {
  if (uid == g.owner_uid) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("group ", g.id, ": uid ", uid < 0 ? std::string("(remote)") : absl::StrCat(uid),
                   " is not admitted (the group belongs to uid ",
                   g.owner_uid < 0 ? std::string("(remote)") : absl::StrCat(g.owner_uid), ")"));
}

inline std::string UnitSummary(const PlanUnit& u) {
  return absl::StrCat("\"", u.module, "\" (", u.module_type, ", ", u.params.size(), " params, ",
                      u.numel, " elements, ", DTypeName(u.dtype), ")");
}

// True when registering `b` would nest FSDP units inside those of `a` or the other way round.
inline bool Nested(const std::string& a, const std::string& b) {
  auto inside = [](const std::string& outer, const std::string& inner) {
    return outer.empty() ||
           (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
            inner[outer.size()] == '.');
  };
  return inside(a, b) || inside(b, a);
}

// A module path as error texts quote it: at most kMaxQuotedBytes of it (README "Limits").
inline std::string Display(const std::string& module) {
  return module.empty() ? std::string("\"\" (the root)")
                        : absl::StrCat("\"", Truncated(module), "\"");
}

// Units of `plan` whose module is `path` (recurse=false) or in its subtree (recurse=true).
inline std::vector<int32_t> SelectUnits(const Plan& plan, const std::string& path, bool recurse) {
  std::vector<int32_t> units;
  for (const PlanUnit& u : plan.units) {
    const bool exact = u.module == path;
    const bool below = path.empty() || (u.module.size() > path.size() &&
                                        u.module.compare(0, path.size(), path) == 0 &&
                                        u.module[path.size()] == '.');
    if (exact || (recurse && below)) units.push_back(u.index);
  }
  return units;
}

inline collective::ConstBuffer ConstOf(const Buffer& b, DType dtype) {
  return b.view(dtype).AsConst();
}
inline collective::MutableBuffer MutableOf(const Buffer* b, DType dtype) {
  if (b == nullptr) return collective::MutableBuffer{nullptr, 0, dtype};
  return b->view(dtype);
}

// A coordinator no group has used for this long gets its watch stream closed.
inline constexpr absl::Duration kUnwatchAfter = absl::Seconds(10);

// A kept buffer idle this long gives its pages back (KeptBufferPool::kIdleRelease).
inline constexpr absl::Duration kKeptIdleRelease = KeptBufferPool::kIdleRelease;

inline void CopyText(absl::string_view text, char* out, size_t size) {
  std::memset(out, 0, size);
  std::memcpy(out, text.data(), std::min(text.size(), size - 1));
}
inline std::string TextOf(const char* text, size_t size) {
  return std::string(text, strnlen(text, size));
}

// The "unit" of the agreement all-gathers (in the collective's fingerprint, so a rank that
// ends a summon while another commits fails with a mismatch instead of agreeing).
inline constexpr int64_t kEndAgreeUnit = -2;
inline constexpr int64_t kCommitAgreeUnit = -3;

// In the status of a failure caused by a rank's session ending ("rank 2's session ended
// ..."): daemons that learn of it from the coordinator let their running ops complete first.
inline constexpr char kSessionEndedMarker[] = "'s session ";

// How long a departure's failure waits for the ops the departed rank had joined to complete
// (FailDeferred). They normally take milliseconds; one that takes longer is stuck, and the
// group fails then rather than at the op's deadline.
inline constexpr absl::Duration kDeferFailureAtMost = absl::Seconds(2);

// Failed writeback Ends remembered per group for repeated Ends.
inline constexpr size_t kFailedEndsKept = 256;

// What each rank contributes to a writeback End's or a Commit's agreement (an all-gather):
// every rank reaches the same verdict from the same records, so all apply or none.
struct AgreeRecord {
  uint8_t ok;     // 1: this rank can apply
  uint8_t stale;  // 1: refused because the rank's views predate a rollback
  uint8_t reserved[6];
  uint64_t generation;  // the rank's committed generation
  char text[240];       // why not; NUL-padded, truncated
};
static_assert(sizeof(AgreeRecord) == 256);

inline constexpr char kAlreadyUnsharding[] =
    "Cannot manually unshard parameters when already unsharding parameters";

// Every durable (live, committed) buffer pair of `rank` in registration `reg`
// (GroupManager::Registered), unit by unit: the shard, then its optimizer state buffers in
// spec order (only where the rank registered state). Gradient shards are not durable (the next
// reduce-scatter overwrites them). The one list that commits, rollbacks and anything that
// persists a committed step (restart records, checkpoints) walk. Empty for a rank without
// shards. REQUIRES: the caller holds the manager's lock (it reads `reg`).
template <typename R>
std::vector<DurablePair> DurableBuffers(const R& reg, int32_t rank) {
  std::vector<DurablePair> out;
  if (rank < 0 || rank >= static_cast<int32_t>(reg.shards_by_rank.size())) return out;
  const auto& shards = reg.shards_by_rank[rank];
  const auto* committed =
      rank < static_cast<int32_t>(reg.committed.size()) ? &reg.committed[rank] : nullptr;
  const auto* committed_state = rank < static_cast<int32_t>(reg.committed_state.size())
                                    ? &reg.committed_state[rank]
                                    : nullptr;
  for (size_t u = 0; u < shards.size(); ++u) {
    if (committed != nullptr && u < committed->size()) {
      out.push_back(DurablePair{shards[u].unit, "shard", shards[u].shard, (*committed)[u]});
    }
    if (committed_state == nullptr || u >= committed_state->size()) continue;
    const auto& kept = (*committed_state)[u];
    for (size_t i = 0; i < shards[u].state.size() && i < kept.size(); ++i) {
      out.push_back(
          DurablePair{shards[u].unit,
                      absl::StrCat("state ", i < reg.state_specs.size() ? reg.state_specs[i].name
                                                                        : std::to_string(i)),
                      shards[u].state[i], kept[i]});
    }
  }
  return out;
}

}  // namespace internal

namespace internal {

// Safety net against a silent mix: drops every registered module of `g` whose local ranks hold
// different committed generations (MixedGenerations) as lost, with an error naming each rank's
// generation, instead of rolling it back or handing it out. `when` says where it was found
// ("at the re-form at epoch 3"). Other daemons learn of it from the module's HeldKey ("mixed")
// or, once dropped, from the "lost" entry this daemon reports. Returns how many were dropped.
// The dropped modules' buffers are freed through `after` (after the group's lock).
template <typename G>
int DropMixedModules(G& g, const std::string& when, AfterUnlock* after)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
  int dropped = 0;
  for (auto it = g.registered.begin(); it != g.registered.end();) {
    const std::string mixed = MixedGenerations(it->second);
    if (mixed.empty() || it->second.busy > 0) {
      ++it;
      continue;
    }
    std::string why = absl::StrCat(
        "group ", g.id, ": module ", Display(it->first),
        " lost: its ranks on this daemon hold different committed generations (", mixed, ") ", when,
        ": a commit reached some of them only (a daemon died inside it); no "
        "generation is held by every rank, so it was dropped on every daemon instead of "
        "handing out a mix: register it afresh on every rank (or restore it)");
    FS_LOG(WARNING) << why;
    g.lost[it->first] = std::move(why);
    auto next = std::next(it);
    after->Destroy(g.registered.extract(it));  // its buffers go with it, after the lock
    it = next;
    ++dropped;
  }
  return dropped;
}

}  // namespace internal

}  // namespace flatshard::server
