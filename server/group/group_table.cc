#include "server/group/group_table.h"

#include <utility>

namespace flatshard::server {
namespace {

std::shared_ptr<Group> MakeGoneGroup() {
  auto g = std::make_shared<Group>();
  absl::MutexLock lock(&g->mu);
  g->removed = true;
  return g;
}

}  // namespace

GroupTable::GroupTable() : gone_(MakeGoneGroup()) {}

std::shared_ptr<Group> GroupTable::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(id);
  return it == groups_.end() ? nullptr : it->second;
}

std::shared_ptr<Group> GroupTable::FindOrGone(const std::string& id) const {
  std::shared_ptr<Group> g = Find(id);
  return g != nullptr ? g : gone_;
}

std::vector<std::shared_ptr<Group>> GroupTable::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Group>> all;
  all.reserve(groups_.size());
  for (const auto& [id, g] : groups_) all.push_back(g);
  return all;
}

absl::StatusOr<std::shared_ptr<Group>> GroupTable::FindOrMake(
    const std::string& id,
    absl::FunctionRef<absl::StatusOr<std::shared_ptr<Group>>(const Map&)> make) {
  absl::MutexLock lock(&mu_);
  if (auto it = groups_.find(id); it != groups_.end()) return it->second;
  absl::StatusOr<std::shared_ptr<Group>> made = make(groups_);
  if (made.ok()) groups_[id] = *made;
  return made;
}

void GroupTable::Insert(std::shared_ptr<Group> g) {
  absl::MutexLock lock(&mu_);
  const std::string id = g->id;
  groups_[id] = std::move(g);
}

void GroupTable::Erase(const Group& g) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(g.id);
  if (it != groups_.end() && it->second.get() == &g) groups_.erase(it);
}

bool GroupTable::AnyWithCoordinator(const std::string& coordinator) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, g] : groups_) {
    if (g->coordinator == coordinator) return true;
  }
  return false;
}

}  // namespace flatshard::server
