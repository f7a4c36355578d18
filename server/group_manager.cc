// GroupManager: builds the daemon core's owners and routes each call to its owner.

#include "server/group_manager.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/checkpoint/checkpoint_peer_client.h"

namespace flatshard::server {
namespace {

RecordsOptions RecordsOptionsOf(const GroupManagerOptions& options, ShardStore* store,
                                RankDevices* devices, Clock* clock, GroupTable* table) {
  RecordsOptions r;
  r.state_dir = options.state_dir;
  r.store = store;
  r.devices = devices;
  r.clock = clock;
  r.gpus = options.gpus;
  r.table = table;
  r.testing_commit_copy_pause = options.testing_commit_copy_pause;
  return r;
}

std::unique_ptr<collective::CommunicatorFactory> MakeFactory(GroupManagerOptions& options) {
  FS_CHECK(options.gpus.empty() || options.copier != nullptr)
      << "a GPU daemon needs a DeviceCopier";
  collective::CommunicatorFactoryOptions factory;
  factory.remote = std::move(options.remote_backend);
  factory.nccl = std::move(options.nccl_backend);
  factory.copier = options.copier;
  factory.registry = options.backend_registry;
  absl::StatusOr<std::unique_ptr<collective::CommunicatorFactory>> comms =
      collective::CommunicatorFactory::Create(std::move(factory));
  FS_CHECK(comms.ok()) << comms.status();
  return *std::move(comms);
}

}  // namespace

GroupManager::GroupManager(ShardStore* store, GroupManagerOptions options)
    : store_(store),
      gpus_(options.gpus),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      devices_(gpus_, options.gpu_device_ordering),
      comms_(MakeFactory(options)),
      kept_pool_(KeptBufferPool::Create(store, clock_)),
      records_(RecordsOptionsOf(options, store, &devices_, clock_, &table_)) {
  ModulesOptions m;
  m.store = store_;
  m.devices = &devices_;
  m.clock = clock_;
  m.gpus = gpus_;
  m.kept_pool = kept_pool_;
  m.table = &table_;
  m.records = &records_;
  MembershipOptions g;
  g.self = std::move(options.self);
  g.lease_timeout = options.lease_timeout;
  g.group_idle_timeout = options.group_idle_timeout;
  g.max_groups_per_uid = options.max_groups_per_uid;
  g.clock = clock_;
  g.gpus = gpus_;
  g.devices = &devices_;
  g.comms = comms_.get();
  g.engine = &engine_;
  g.kept_pool = kept_pool_;
  g.table = &table_;
  g.records = &records_;
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  if (!g.self.peer_address.empty() && comms_->has_remote()) {
    g.self.backend_address = comms_->RemoteAddress();
    g.self.nccl = comms_->has_nccl();
    g.self.collective_settings = comms_->RemoteSettings();
    peer_credentials = options.peer.credentials;
  }
  const peer::DaemonIdentity self = g.self;
  m.shutdown = &shutting_down_;
  modules_ = std::make_unique<Modules>(std::move(m));
  g.modules = modules_.get();
  g.shutdown = &shutting_down_;
  membership_ = std::make_unique<Membership>(std::move(g));
  checkpoint_peers_ = std::make_unique<CheckpointPeerClient>(std::move(peer_credentials));
  CheckpointsOptions c;
  c.store = store_;
  c.devices = &devices_;
  c.table = &table_;
  c.modules = modules_.get();
  c.records = &records_;
  c.shutdown = &shutting_down_;
  c.peers = checkpoint_peers_.get();
  c.self_peer_address = self.peer_address;
  checkpoints_ = std::make_unique<Checkpoints>(std::move(c));
  if (!self.peer_address.empty() && comms_->has_remote()) {
    peer_ = std::make_unique<peer::PeerClient>(self, std::move(options.peer), this);
  }
  membership_->Start(peer_.get());
}

GroupManager::~GroupManager() {
  membership_->Shutdown();  // joins the deadline loop
  peer_.reset();            // its pending rendezvous fail now, while the manager is whole
  // Connects still queued finish (FinishConnect drops them: shutting down); then no thread but
  // the callers' can enter the manager.
  comms_.reset();
  devices_.Stop();  // the device waits still queued end now, while the manager is whole
  // Shutdown aborted every group's collectives, but their ops fail on the engine's watchdog
  // thread, and a completion may be running on a backend thread: callbacks that lock a group
  // and read it. Wait for them before any member goes. Invariant: a callback of an op of
  // group G runs only while G's CollectiveGroup is alive (the engine holds it across OnDone,
  // an abort across the abort), and the manager's own references (Group::coll,
  // OpenSummon::coll) are dropped here; the others (op callbacks, the engine's map) go once
  // the aborted ops failed. So once none is left, no callback of this manager runs.
  std::vector<std::weak_ptr<collective::CollectiveGroup>> colls;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.coll == nullptr) continue;
    colls.push_back(g.coll);
    engine_.RemoveGroup(g.id, absl::UnavailableError("flatshardd is shutting down")).IgnoreError();
    g.coll = nullptr;
    for (auto& [summon, open] : g.open_summons) open.coll = nullptr;
  }
  const absl::Time until = absl::Now() + absl::Seconds(10);
  for (const std::weak_ptr<collective::CollectiveGroup>& c : colls) {
    while (!c.expired() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    if (!c.expired()) {
      FS_LOG(ERROR) << "a group's collectives were still referenced 10s after shutdown";
      break;
    }
  }
}

// ---- Membership ----
void GroupManager::Join(const JoinArgs& args, absl::Time deadline, JoinCallback done) {
  membership_->Join(args, deadline, std::move(done));
}
absl::Status GroupManager::AttachLease(const Caller& caller) {
  return membership_->AttachLease(caller);
}
absl::Status GroupManager::CheckCaller(const Caller& caller) const {
  return membership_->CheckCaller(caller);
}
absl::Status GroupManager::Leave(const Caller& caller) { return membership_->Leave(caller); }
void GroupManager::EndSession(const std::string& group, uint64_t session) {
  membership_->EndSession(group, session);
}
void GroupManager::Shutdown() { membership_->Shutdown(); }
absl::StatusOr<GroupManager::DeletedGroup> GroupManager::DeleteGroup(const std::string& group,
                                                                     int64_t uid, bool privileged) {
  return membership_->DeleteGroup(group, uid, privileged);
}
std::vector<GroupManager::GroupInfo> GroupManager::ListGroups() const {
  return membership_->ListGroups();
}
std::vector<GroupManager::GroupCollectives> GroupManager::ListCollectives(
    const std::string& group) const {
  return membership_->ListCollectives(group);
}
void GroupManager::StartDrain() { membership_->StartDrain(); }
bool GroupManager::StopDrain() { return membership_->StopDrain(); }
GroupManager::Stats GroupManager::GetStats() const { return membership_->GetStats(); }
void GroupManager::OnTable(const std::string& coordinator, const peer::PeerTable& table) {
  membership_->OnTable(coordinator, table);
}
void GroupManager::OnGroupFailed(const std::string& coordinator, const std::string& group,
                                 uint64_t epoch, const absl::Status& status) {
  membership_->OnGroupFailed(coordinator, group, epoch, status);
}
void GroupManager::OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) {
  membership_->OnCoordinatorLost(coordinator, status);
}

// ---- Modules ----
void GroupManager::Register(const Caller& caller, const std::string& module,
                            const absl::StatusOr<Manifest>& manifest,
                            const absl::StatusOr<Policy>& policy, InitMode init,
                            absl::Time deadline, RegisterCallback done) {
  modules_->Register(caller, module, manifest, policy, init, deadline, std::move(done));
}
void GroupManager::Summon(const Caller& caller, const std::string& module, const std::string& path,
                          const SummonOptions& options, absl::Time deadline, SummonCallback done,
                          const gpu::IpcEventRef& written) {
  modules_->Summon(caller, module, path, options, deadline, std::move(done), written);
}
void GroupManager::EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline,
                             StatusCallback done, const gpu::IpcEventRef& written) {
  modules_->EndSummon(caller, summon, deadline, std::move(done), written);
}
absl::StatusOr<std::shared_ptr<Buffer>> GroupManager::BeginReduceScatter(const Caller& caller,
                                                                         const std::string& module,
                                                                         int32_t unit,
                                                                         bool may_allocate) {
  return modules_->BeginReduceScatter(caller, module, unit, may_allocate);
}
void GroupManager::FinishReduceScatter(const Caller& caller, const std::string& module,
                                       int32_t unit, ReduceOp op, bool accumulate,
                                       absl::Time deadline, StatusCallback done,
                                       const gpu::IpcEventRef& written) {
  modules_->FinishReduceScatter(caller, module, unit, op, accumulate, deadline, std::move(done),
                                written);
}
gpu::IpcEventRef GroupManager::RecordReady(int32_t rank) { return modules_->RecordReady(rank); }
absl::StatusOr<std::string> GroupManager::ModuleOfSummon(const Caller& caller,
                                                         uint64_t summon) const {
  return modules_->ModuleOfSummon(caller, summon);
}

absl::StatusOr<int64_t> GroupManager::SummonBytes(const Caller& caller, const std::string& module,
                                                  const std::string& path,
                                                  const SummonOptions& options) const {
  return modules_->SummonBytes(caller, module, path, options);
}
absl::StatusOr<int64_t> GroupManager::OpenSummonBytes(const Caller& caller, uint64_t summon,
                                                      bool* writeback) const {
  return modules_->OpenSummonBytes(caller, summon, writeback);
}

absl::StatusOr<uint64_t> GroupManager::Generation(const Caller& caller,
                                                  const std::string& module) const {
  return modules_->Generation(caller, module);
}

absl::StatusOr<RegisterResult> GroupManager::GetShards(const Caller& caller,
                                                       const std::string& module) {
  return modules_->GetShards(caller, module);
}
void GroupManager::Commit(const Caller& caller, const std::string& module, absl::Time deadline,
                          CommitCallback done, const gpu::IpcEventRef& written) {
  modules_->Commit(caller, module, deadline, std::move(done), written);
}
absl::StatusOr<RegisterStateResult> GroupManager::RegisterState(
    const Caller& caller, const std::string& module, const std::vector<StateSpec>& specs) {
  return modules_->RegisterState(caller, module, specs);
}
absl::StatusOr<std::vector<GroupManager::ModuleUnits>> GroupManager::ListUnits(
    const std::string& group, const std::optional<std::string>& module) const {
  return modules_->ListUnits(group, module);
}

// ---- Records ----
GroupManager::AdoptSummary GroupManager::AdoptGroups(
    const std::vector<state::GroupRecord>& records) {
  return records_.AdoptGroups(records);
}
void GroupManager::ForgetState() { records_.Forget(); }
void GroupManager::KeepDeviceShards() { records_.KeepDeviceShards(); }

// ---- Checkpoints ----
absl::StatusOr<GroupManager::CheckpointResult> GroupManager::SaveCheckpoint(
    const CheckpointArgs& args, CheckpointProgress* progress) {
  return checkpoints_->SaveCheckpoint(args, progress);
}
absl::StatusOr<GroupManager::CheckpointResult> GroupManager::LoadCheckpoint(
    const CheckpointArgs& args, CheckpointProgress* progress) {
  return checkpoints_->LoadCheckpoint(args, progress);
}

// ---- Published weights ----
absl::StatusOr<GroupManager::PublisherGroup> GroupManager::CheckPublisher(
    const Caller& caller) const {
  FS_RETURN_IF_ERROR(CheckCaller(caller));
  std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
  absl::MutexLock lock(&held->mu);
  if (held->removed) {
    return absl::NotFoundError(absl::StrCat("no group ", Truncated(caller.group), " here"));
  }
  PublisherGroup out{held->world_size,
                     held->multi(),
                     held->owner_uid,
                     static_cast<int32_t>(held->local_ranks.size()),
                     "",
                     ""};
  if (out.multi) {
    out.token = held->token;
    const bool local0 =
        std::find(held->local_ranks.begin(), held->local_ranks.end(), 0) != held->local_ranks.end();
    if (!local0 && !held->table.rank_daemons.empty()) {
      out.leader = held->table.rank_daemons[0].peer_address;
    }
  }
  return out;
}
absl::Status GroupManager::ReadCommitted(
    const CheckpointArgs& args, const std::function<absl::Status(const CommittedCopies&)>& read) {
  return checkpoints_->ReadCommitted(args, read);
}

}  // namespace flatshard::server
