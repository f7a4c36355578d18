#include "server/publish/publish_rounds.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/group/access.h"

namespace flatshard::server {
namespace {
constexpr size_t kKept = 16;  // pairings and results kept (others ask right away)

template <typename M>
void Trim(M& m) {
  while (m.size() > kKept) m.erase(m.begin());
}
}  // namespace

uint64_t PublishRounds::Arrived(const std::string& group, const std::string& module,
                                const std::string& token, bool leader, absl::Status refusal) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  r.token = token;
  ++r.last;
  if (!leader) r.unread.push_back(r.last);
  if (!refusal.ok()) {
    r.refused[r.last] = std::move(refusal);
    Trim(r.refused);
  }
  return r.last;
}

absl::Status PublishRounds::TakeArrival(const std::string& group, const std::string& module,
                                        uint64_t seq, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  // The batch's refusal (Arrived), else OK.
  auto verdict = [&](uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = r.refused.find(id);
    return it == r.refused.end() ? absl::OkStatus() : it->second;
  };
  for (const auto& [id, s] : r.leader_seq) {
    if (s == seq) return verdict(id);  // the leader reads again (a generation changed)
  }
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ || !r.unread.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (stopped_) return absl::UnavailableError("flatshardd is shutting down");
  if (r.unread.empty()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "group ", group, " module \"", module, "\": this daemon's ranks did not call Publish ",
        "(the leader's publish #", seq, ") in time (it is collective: every rank calls it)"));
  }
  const uint64_t id = r.unread.front();
  r.leader_seq[id] = seq;
  r.unread.pop_front();
  Trim(r.leader_seq);
  return verdict(id);
}

absl::StatusOr<uint64_t> PublishRounds::AwaitLeaderSeq(const std::string& group,
                                                       const std::string& module, uint64_t id,
                                                       absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopped_ || r.leader_seq.contains(id);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (auto it = r.leader_seq.find(id); it != r.leader_seq.end()) return it->second;
  r.unread.erase(std::remove(r.unread.begin(), r.unread.end(), id), r.unread.end());
  if (stopped_) return absl::UnavailableError("flatshardd is shutting down");
  return absl::DeadlineExceededError(absl::StrCat(
      "group ", group, " module \"", module, "\": the leader (rank 0's daemon) did not read ",
      "this daemon's shards in time (did rank 0's daemon's ranks call Publish?)"));
}

void PublishRounds::Done(const std::string& group, const std::string& module, uint64_t seq,
                         absl::StatusOr<uint64_t> version) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  r.results.insert_or_assign(seq, std::move(version));
  Trim(r.results);
}

absl::StatusOr<uint64_t> PublishRounds::AwaitDone(const std::string& group,
                                                  const std::string& module,
                                                  const std::string& token, uint64_t seq,
                                                  absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopped_ || r.results.contains(seq);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (stopped_) return absl::UnavailableError("flatshardd is shutting down");
  if (!internal::TokensEqual(token, r.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("group ", group, ": wrong token in a request of a peer for publish #", seq));
  }
  if (auto it = r.results.find(seq); it != r.results.end()) return it->second;
  return absl::DeadlineExceededError(
      absl::StrCat("group ", group, " module \"", module, "\": publish #", seq,
                   " was not built on the leader (rank 0's daemon) in time"));
}

void PublishRounds::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

}  // namespace flatshard::server
