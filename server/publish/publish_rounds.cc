#include "server/publish/publish_rounds.h"

#include "absl/strings/str_cat.h"
#include "server/group/access.h"

namespace flatshard::server {
namespace {
constexpr size_t kResultsKept = 8;  // followers ask right after the leader built it
}  // namespace

uint64_t PublishRounds::Arrived(const std::string& group, const std::string& module,
                                const std::string& token) {
  absl::MutexLock lock(&mu_);
  Round& r = rounds_[Key{group, module}];
  r.token = token;
  return ++r.arrived;
}

absl::Status PublishRounds::AwaitArrived(const std::string& group, const std::string& module,
                                         uint64_t seq, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopped_ || rounds_[Key{group, module}].arrived >= seq;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (stopped_) return absl::UnavailableError("flatshardd is shutting down");
  if (rounds_[Key{group, module}].arrived >= seq) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat("group ", group, " module \"", module, "\": this daemon's ranks did not call ",
                   "Publish (publish #", seq, ") in time (it is collective: every rank calls it)"));
}

void PublishRounds::Done(const std::string& group, const std::string& module, uint64_t seq,
                         absl::StatusOr<uint64_t> version) {
  absl::MutexLock lock(&mu_);
  auto& results = rounds_[Key{group, module}].results;
  results.insert_or_assign(seq, std::move(version));
  while (results.size() > kResultsKept) results.erase(results.begin());
}

absl::StatusOr<uint64_t> PublishRounds::AwaitDone(const std::string& group,
                                                  const std::string& module,
                                                  const std::string& token, uint64_t seq,
                                                  absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopped_ || rounds_[Key{group, module}].results.contains(seq);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (stopped_) return absl::UnavailableError("flatshardd is shutting down");
  Round& r = rounds_[Key{group, module}];
  if (!internal::TokensEqual(token, r.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("group ", group, ": wrong token in a request of a peer for publish #", seq));
  }
  auto& results = r.results;
  if (auto it = results.find(seq); it != results.end()) return it->second;
  return absl::DeadlineExceededError(
      absl::StrCat("group ", group, " module \"", module, "\": publish #", seq,
                   " was not built on the leader (rank 0's daemon) in time"));
}

void PublishRounds::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

}  // namespace flatshard::server
