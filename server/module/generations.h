#pragma once
// The committed generations of a registered module as daemons compare them at a re-form, the
// durable buffer pairs a commit, rollback or restart record walks, and the safety net that drops
// a module whose local ranks hold a mix of generations. Shared by the module, durability and
// membership owners. Every function reads or edits a Registered and so runs under its group's
// lock (Group::mu).

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/after_unlock.h"
#include "common/logging.h"
#include "server/group/group.h"
#include "server/messages.h"
#include "server/module/module.h"

namespace flatshard::server::internal {

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
// The generation rank `r`'s shards hold since it voted yes to a Commit whose outcome it has
// not learnt (Registered::voted); 0: none.
template <typename R>
uint64_t VotedOf(const R& reg, size_t r) {
  return r < reg.voted.size() ? reg.voted[r] : 0;
}

// The generations the ranks of `reg` held here (those with shards) can all end at, [lo, hi]:
// a rank holds its committed generation, or the generation of a commit under way whose copy
// started (ready: it completes whatever happens, a restart finishes it from the shards), or,
// when it voted yes to a Commit whose outcome it has not learnt (VotedOf), either its
// committed generation (rolled back) or the voted one (rolled forward from its shards). A
// Commit reaches one rank only once every rank voted yes with its shards written, so a voted
// rank's shards hold what the others committed. `mixed`: no generation is possible for
// every rank ("rank 0: generation 2, rank 1: generation 1"); never handed out.
struct Possible {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool any = false;
  std::string mixed;
};
template <typename R>
Possible PossibleGenerations(const R& reg) {
  Possible p;
  if (!reg.initialized) return p;
  std::vector<std::string> parts;
  uint64_t lo = 0, hi = UINT64_MAX;
  for (size_t r = 0; r < reg.generation.size() && r < reg.shards_by_rank.size(); ++r) {
    if (reg.shards_by_rank[r].empty()) continue;
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
    const bool voted = !committing && VotedOf(reg, r) == gen + 1;
    lo = std::max(lo, gen);
    hi = std::min(hi, voted ? gen + 1 : gen);
    p.any = true;
    parts.push_back(absl::StrCat("rank ", r, ": generation ", gen,
                                 committing ? " (committing)"
                                 : voted    ? absl::StrCat(" (voted ", gen + 1, ")")
                                            : ""));
  }
  if (!p.any) return p;
  p.lo = lo;
  p.hi = hi;
  if (lo > hi) p.mixed = absl::StrJoin(parts, ", ");
  return p;
}
// The generations of the ranks of `reg` held here when no generation is possible for all of
// them (PossibleGenerations); empty otherwise. Such a module is a mix (a commit reached some
// local ranks only) and is never handed out: it is dropped as lost at the next re-form
// (ReconcileModules, HeldKey).
template <typename R>
std::string MixedGenerations(const R& reg) {
  return PossibleGenerations(reg).mixed;
}
// GPU daemons keeping host copies (server/durable/device_host_copies.h): a complete host copy of
// generation G-1 that rank `r`, whose device committed copies hold G, can be rolled back to
// when another daemon's host copy of G never completed (it was killed between the commit and
// the end of its copy): the recorded slot while the copy of G is under way, else the spare
// slot (Registered::host_spare_generation). `spare`: which one. None for host ranks.
struct HostSlot {
  uint64_t generation = 0;
  bool spare = false;
};
template <typename R>
std::optional<HostSlot> HostFallback(const R& reg, size_t r) {
  if (r >= reg.generation.size() || reg.generation[r] == 0 || r >= reg.committed.size() ||
      reg.committed[r].empty() || reg.committed[r][0] == nullptr ||
      !reg.committed[r][0]->on_device()) {
    return std::nullopt;
  }
  const uint64_t want = reg.generation[r] - 1;
  if (r < reg.host_committed.size() && !reg.host_committed[r].empty() &&
      r < reg.host_generation.size() && reg.host_generation[r] == want) {
    return HostSlot{want, false};
  }
  if (r < reg.host_spare.size() && !reg.host_spare[r].empty() &&
      r < reg.host_spare_generation.size() &&
      reg.host_spare_generation[r] == static_cast<int64_t>(want)) {
    return HostSlot{want, true};
  }
  return std::nullopt;
}
// The generation every local rank of `reg` can be rolled back to from its host copy (one
// below the one they all hold, nothing under way); none otherwise.
template <typename R>
std::optional<uint64_t> ModuleHostFallback(const R& reg) {
  if (!reg.initialized || reg.pending_commit.has_value() || reg.voted_commit != 0) {
    return std::nullopt;
  }
  std::optional<uint64_t> out;
  for (size_t r = 0; r < reg.generation.size() && r < reg.shards_by_rank.size(); ++r) {
    if (reg.shards_by_rank[r].empty()) continue;
    const std::optional<HostSlot> slot = HostFallback(reg, r);
    if (!slot.has_value() || VotedOf(reg, r) != 0 ||
        (out.has_value() && *out != slot->generation)) {
      return std::nullopt;
    }
    out = slot->generation;
  }
  return out;
}

// A module whose local ranks hold different generations is reported under the generation
// "mixed (rank 0: generation 2, ...)", which no other daemon holds, so every daemon of the
// group drops it as lost and names each rank's generation (ReconcileModules). One whose voted
// ranks may end at either of two generations is reported as "G|G+1": the daemons resolve it
// to the lowest generation every daemon can end at (ResolveHeld). A GPU daemon's module that
// holds G and can be rolled back to G-1 from its host copies (ModuleHostFallback) is reported
// as "G-1<G": resolved to G unless another daemon can only end at G-1. One not initialised here
// (InitHeld) is reported as kNotInitialised (InitUndoneEverywhere).
// What a module not initialised here reports instead of a generation (HeldKey): no initial
// values are committed, nor will be by an init whose copies are under way on every local rank.
inline constexpr char kNotInitialised[] = "uninit";
// Whether `reg`'s initial values are committed here, or will be whatever happens (its init's
// copies started on every local rank: a restart finishes them from the shards).
template <typename R>
bool InitHeld(const R& reg) {
  if (reg.initialized) return true;
  if (!reg.pending_commit.has_value() || reg.pending_commit->kind != "init") return false;
  const auto& ready = reg.pending_commit->ready_ranks;
  for (size_t r = 0; r < reg.shards_by_rank.size(); ++r) {
    if (!reg.shards_by_rank[r].empty() &&
        std::find(ready.begin(), ready.end(), static_cast<int32_t>(r)) == ready.end()) {
      return false;
    }
  }
  return true;
}

template <typename R>
std::string HeldKey(const std::string& module, const R& reg) {
  if (!InitHeld(reg)) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", kNotInitialised);
  }
  const Possible p = PossibleGenerations(reg);
  if (!p.mixed.empty()) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1fmixed (", p.mixed, ")");
  }
  const uint64_t held = HeldGeneration(reg);
  if (p.any && p.lo < p.hi && held < p.hi) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", p.lo, "|", p.hi);
  }
  const uint64_t at = std::max(held, p.lo);
  if (const std::optional<uint64_t> back = ModuleHostFallback(reg); back && *back + 1 == at) {
    return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", *back, "<", at);
  }
  return absl::StrCat(module, "\x1f", reg.plan.fingerprint, "\x1f", at);
}
// The generation every daemon resolves a module to from what each reported (HeldKey's
// generations: "G", "G|G+1" or "G<G+1"): one all of them can end at; none when they share
// none (a "mixed" report, or "2" against "0"). Voted reports ("G|G+1") prefer the lower one (no
// trainer was answered G+1 unless some daemon holds it), the others the generation they hold
// (a host copy is a fallback, not a reason to undo a commit): the lowest preference of the
// reports that are not votes, within the range all allow; the range's bottom when all are.
inline std::optional<uint64_t> ResolveHeld(const std::vector<std::string>& generations) {
  uint64_t lo = 0, hi = UINT64_MAX, preferred = UINT64_MAX;
  for (const std::string& g : generations) {
    const size_t sep = g.find_first_of("|<");
    uint64_t a = 0, b = 0;
    if (!absl::SimpleAtoi(g.substr(0, sep), &a)) return std::nullopt;
    if (sep == std::string::npos) {
      b = a;
    } else if (!absl::SimpleAtoi(g.substr(sep + 1), &b)) {
      return std::nullopt;
    }
    lo = std::max(lo, a);
    hi = std::min(hi, b);
    if (sep == std::string::npos || g[sep] == '<') preferred = std::min(preferred, b);
  }
  if (lo > hi) return std::nullopt;
  return preferred == UINT64_MAX ? lo : std::clamp(preferred, lo, hi);
}
// Restarts, a daemon killed during a module's initialisation (its registration, or its init
// End before its record): it comes back without the module, or holds it initialised while
// another daemon's init never completed. No step was trained on it (a daemon's ranks commit a
// step only after every daemon recorded the init) and its initial values are the trainers', so
// the daemons undo the initialisation everywhere (every rank registers and initialises again)
// rather than drop the module as lost. True when the daemons' reports of `module` (`reports`:
// each daemon's HeldModules) differ, yet each either lacks it or holds it with one plan at
// generation 0 or not initialised (kNotInitialised).
inline bool InitUndoneEverywhere(const std::string& module,
                                 const std::vector<const std::vector<std::string>*>& reports) {
  const std::string prefix = absl::StrCat(module, "\x1f");
  std::optional<std::string> fingerprint;
  bool differ = false;
  std::optional<std::string> first;
  for (const std::vector<std::string>* held : reports) {
    auto it = std::find_if(held->begin(), held->end(), [&](const std::string& k) {
      return k.compare(0, prefix.size(), prefix) == 0;
    });
    const std::string key = it == held->end() ? std::string() : *it;
    if (first.has_value() && *first != key) differ = true;
    if (!first.has_value()) first = key;
    if (key.empty()) continue;
    const size_t sep = key.rfind('\x1f');
    if (sep < prefix.size()) return false;  // "lost": no plan
    const std::string generation = key.substr(sep + 1);
    if (generation != "0" && generation != kNotInitialised) return false;
    const std::string fp = key.substr(prefix.size(), sep - prefix.size());
    if (fingerprint.has_value() && *fingerprint != fp) return false;  // another plan
    fingerprint = fp;
  }
  return differ && fingerprint.has_value();
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

// Every durable (live, committed) buffer pair of `rank` in registration `reg`
// (Registered), unit by unit: the shard, then its optimizer state buffers in
// spec order (only where the rank registered state). Gradient shards are not durable (the next
// reduce-scatter overwrites them). The one list that commits, rollbacks and anything that
// persists a committed step (restart records, checkpoints) walk. Empty for a rank without
// shards. REQUIRES: the caller holds the group's lock (it reads `reg`).
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

}  // namespace flatshard::server::internal
