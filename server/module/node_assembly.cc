#include "server/module/node_assembly.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard::server {

void NodeAssembly::Arrive(const std::shared_ptr<SummonSlot>& slot, int32_t rank,
                          const std::vector<int32_t>& locals, absl::Status part,
                          std::optional<absl::Time> deadline, const std::string& what,
                          absl::AnyInvocable<void(absl::Status)> answer) {
  std::vector<absl::AnyInvocable<void(absl::Status)>> ready;
  absl::Status verdict;
  {
    absl::MutexLock lock(&slot->assembly_mu);
    if (!part.ok() && slot->assembly_error.ok()) slot->assembly_error = std::move(part);
    slot->assembled.insert(rank);
    slot->waiting.push_back(std::move(answer));
    const bool whole = slot->assembled.size() >= locals.size();
    if (slot->assembly_error.ok() && !whole) {
      // The first rank to wait without a collective's deadline bounds the wait for all.
      if (deadline.has_value() && slot->assembly_timer == collective::DeadlineTimer::kNoTimer) {
        const absl::Duration budget = *deadline - absl::Now();
        slot->assembly_timer = timer_->Schedule(
            *deadline, [weak = std::weak_ptr<SummonSlot>(slot), locals, what, budget] {
              std::shared_ptr<SummonSlot> s = weak.lock();
              if (s == nullptr) return;
              std::vector<absl::AnyInvocable<void(absl::Status)>> late;
              absl::Status error;
              {
                absl::MutexLock lock(&s->assembly_mu);
                if (!s->assembly_error.ok() || s->waiting.empty()) return;
                std::vector<int32_t> missing;
                for (int32_t r : locals) {
                  if (!s->assembled.contains(r)) missing.push_back(r);
                }
                if (missing.empty()) return;
                s->assembly_error = absl::DeadlineExceededError(
                    absl::StrCat(what, ": local ranks ", absl::StrJoin(missing, ", "),
                                 " did not summon their shards into the node's copy within ",
                                 absl::FormatDuration(absl::Ceil(budget, absl::Milliseconds(1)))));
                error = s->assembly_error;
                late.swap(s->waiting);
              }
              for (auto& f : late) f(error);
            });
      }
      return;
    }
    ready.swap(slot->waiting);
    verdict = slot->assembly_error;
    if (whole)
      timer_->Cancel(std::exchange(slot->assembly_timer, collective::DeadlineTimer::kNoTimer));
  }
  for (auto& f : ready) f(verdict);
}

void NodeAssembly::Fail(const std::shared_ptr<SummonSlot>& slot, int32_t rank,
                        const absl::Status& why) {
  std::vector<absl::AnyInvocable<void(absl::Status)>> ready;
  absl::Status verdict;
  {
    absl::MutexLock lock(&slot->assembly_mu);
    if (slot->assembled.contains(rank) || !slot->assembly_error.ok()) return;
    slot->assembly_error = why;
    verdict = why;
    ready.swap(slot->waiting);
    timer_->Cancel(std::exchange(slot->assembly_timer, collective::DeadlineTimer::kNoTimer));
  }
  for (auto& f : ready) f(verdict);
}

}  // namespace flatshard::server
