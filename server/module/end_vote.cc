// Modules: the vote of a writeback End over several daemons (no module lost to a single
// daemon kill; server/durable/commit_votes.cc has the rule). Its ranks write back into their
// shards after the first agreement (end.cc), so before any committed copy changes each daemon
// records its vote once all its local ranks have written back, and the ranks exchange votes
// (a second agreement): a daemon killed before its vote leaves every daemon at G-1, one
// killed after it is rolled forward or back with the others at the re-form.

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/durable/records.h"
#include "server/module/modules.h"
#include "server/module/unit_ops.h"
#include "server/module/writeback_end.h"

namespace flatshard::server {

void Modules::VoteEnd(std::shared_ptr<const WritebackEnd> end, absl::Status written,
                      absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred) {
  const Caller caller = end->caller;
  const std::string module = end->module;
  const uint64_t k = end->k;
  const uint64_t target = end->target();
  records_.EndVoteArrive(
      caller, module, k, target, /*applying=*/true, std::move(written),
      [this, end = std::move(end), finish = std::move(finish),
       deferred = std::move(deferred)](absl::Status yes) mutable {
        // This daemon's record holds the vote (or every local rank votes no): it goes out.
        internal::AgreeRecord record;
        std::memset(&record, 0, sizeof(record));
        record.ok = yes.ok() ? 1 : 0;
        record.generation = end->generation;
        internal::CopyText(yes.message(), record.text, sizeof(record.text));
        auto coll = end->coll;
        const int32_t world_size = end->world_size;
        const absl::Time deadline = end->deadline;
        const Caller caller = end->caller;
        const std::string what = absl::StrCat("the writeback of summon ", end->summon);
        Agree(coll, caller, record, world_size, internal::kEndVoteAgreeUnit, what, deadline,
              [this, end = std::move(end), finish = std::move(finish),
               deferred = std::move(deferred)](absl::Status s, bool) mutable {
                EndVoted(std::move(end), std::move(s), std::move(finish), std::move(deferred));
              });
      });
}

void Modules::EndVoted(std::shared_ptr<const WritebackEnd> end, absl::Status s,
                       absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred) {
  const Caller& caller = end->caller;
  if (s.ok()) {
    // Every rank voted yes, so every daemon's record holds its vote: the End commits
    // whatever happens now (a daemon killed from here is rolled forward at the re-form).
    {
      std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      auto it = g.removed ? g.registered.end() : g.registered.find(end->module);
      if (it != g.registered.end()) {
        Records::NoteCommitAgreed(it->second, end->target(), end->kind());
      }
    }
    // Queued before the copies on the group's durable strand (testing only).
    records_.RunDurable(caller.group, [target = end->target()] {
      Records::TestingPauseEndVote("before_intent", target);
    });
    records_.EndArrive(caller, end->module, end->k, end->target(), end->kind(), absl::OkStatus(),
                       end->durable, std::move(finish), std::move(deferred));
    return;
  }
  records_.EndNotApplied(caller, end->module, end->k);
  if (!s.GetPayload(internal::kAgreeRefusedPayload).has_value()) {
    // The vote's all-gather failed here (a daemon died, the group re-forms): other ranks may
    // have committed. The shards keep the vote; the re-form resolves it.
    finish(absl::Status(
        s.code(), absl::StrCat("the writeback of summon ", end->summon, " (generation ",
                               end->target(), ") did not complete on this rank: ", s.message(),
                               "; the group's next formation rolls every rank to one committed "
                               "generation (re-join)")));
    return;
  }
  // A rank voted no (its writeback failed): no rank copies; every rank's shards, written
  // already, are restored from its committed copy.
  records_.VoteRefused(
      caller, end->module, [this, end, s = std::move(s), finish = std::move(finish)]() mutable {
        RollbackRank(end->caller, end->module);
        finish(absl::Status(s.code(), absl::StrCat("summon ", end->summon,
                                                   ": no rank's writeback was applied (the "
                                                   "shards were restored to generation ",
                                                   end->generation, "): ", s.message())));
      });
}

}  // namespace flatshard::server
