#include "server/publish/distributed_publish.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace flatshard::server {

absl::Status DistributedPublish::GatherShards(
    const CommittedCopies& c, uint64_t seq, absl::Time deadline, std::vector<int32_t>* ranks,
    std::vector<std::vector<std::shared_ptr<Buffer>>>* by_unit) {
  std::vector<absl::StatusOr<WeightsPeerClient::Shards>> got(c.peers.size(),
                                                             absl::UnknownError("not asked"));
  std::vector<std::thread> threads;
  for (size_t k = 0; k < c.peers.size(); ++k) {
    threads.emplace_back([&, k] {
      got[k] = client_->ReadShards(c.peers[k], c.plan, c.owner_uid, c.group, c.token, c.module, seq,
                                   deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < got.size(); ++k) {
    if (!got[k].ok()) return got[k].status();
    if (got[k]->generation != c.generation) {
      return absl::AbortedError(
          absl::StrCat("group ", c.group, " module \"", c.module, "\": daemon ", c.peers[k],
                       " holds committed generation ", got[k]->generation, ", this daemon ",
                       c.generation, " (a commit landed between the daemons' holds)"));
    }
    for (size_t i = 0; i < got[k]->ranks.size(); ++i) {
      ranks->push_back(got[k]->ranks[i]);
      by_unit->push_back(std::move(got[k]->by_unit[i]));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CopiedVersion> DistributedPublish::FetchFromLeader(const LeaderVersion& which) {
  FS_ASSIGN_OR_RETURN(const uint64_t seq,
                      rounds_.AwaitLeaderSeq(which.group, which.module, which.seq, which.deadline));
  WeightsPeerClient::Fetch f;
  f.group = which.group;
  f.token = which.token;
  f.module = which.module;
  f.seq = seq;
  f.name = which.name;
  f.owner_uid = which.owner_uid;
  f.deadline = which.deadline;
  f.spare = which.spare;
  absl::StatusOr<std::optional<CopiedVersion>> copy = client_->FetchVersion({which.leader}, f);
  if (!copy.ok()) return copy.status();
  if (!copy->has_value()) return absl::InternalError("the leader answered \"not newer\"");
  return **std::move(copy);
}

void DistributedPublish::Shutdown() {
  rounds_.Shutdown();
  client_->Shutdown();
}

}  // namespace flatshard::server
