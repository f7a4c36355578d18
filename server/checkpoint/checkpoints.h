#pragma once
// Checkpoints: the checkpoint owner. Saves and loads of registered modules (README
// "Checkpoints"; the file format is common/checkpoint/checkpoint.h): the hold that keeps a
// module's committed copies still while a save reads them or a load writes them, resharding
// on load, and the other daemons' parts of a multi-daemon group's checkpoint
// (CheckpointPeerClient asks them; CheckpointPeerService answers theirs).
//
// State: none of its own beyond a call's; the hold is counted in the module's Registered
// (ckpt_hold, after_ckpt) under the group's lock. Blocking (file I/O, device copies): the
// calls run on the admin service's threads, never on a gRPC reactor. Thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/checkpoint/checkpoint.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/state_spec.h"
#include "server/group/group_table.h"
#include "server/module/module.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"

namespace flatshard::server {

class Modules;
class Records;
class CheckpointPeerClient;

// Progress of a save or load, read by another thread while it runs.
struct CheckpointProgress {
  enum Phase : int { kWaiting = 0, kVerifying = 1, kWriting = 2, kLoading = 3, kDone = 4 };
  std::atomic<int> phase{kWaiting};
  std::atomic<int64_t> done_bytes{0};
  std::atomic<int64_t> total_bytes{0};
};
struct CheckpointArgs {
  std::string group;
  std::string module;
  std::string dir;          // save: the directory; load: a checkpoint directory, or
  std::string safetensors;  // load: a safetensors file
  int64_t uid = -1;         // the caller's (-1 remote); `privileged`: root or the daemon's
  bool privileged = false;
  // How long to wait for copies of the committed shards in flight to finish.
  absl::Duration wait = absl::Seconds(30);
  // Multi-daemon groups: another daemon asks for this daemon's ranks' part (the group's
  // token instead of a uid; no metadata written, no other daemon asked).
  bool from_peer = false;
  std::string token;
};
struct CheckpointResult {
  uint64_t generation = 0;
  int64_t bytes = 0;
  int32_t files = 0;
  int32_t ranks = 0;
  int64_t unused_tensors = 0;
  // A save for a peer: the files and tensors this daemon wrote.
  std::vector<checkpoint::FileEntry> written_files;
  std::vector<checkpoint::TensorEntry> written_tensors;
};

struct CheckpointsOptions {
  ShardStore* store = nullptr;
  RankDevices* devices = nullptr;
  GroupTable* table = nullptr;
  Modules* modules = nullptr;
  Records* records = nullptr;
  const std::atomic<bool>* shutdown = nullptr;
  // Multi-daemon groups: how the other daemons are asked for their ranks' parts.
  CheckpointPeerClient* peers = nullptr;
  std::string self_peer_address;  // this daemon's peer address (empty: none)
};

// The committed copies of a module held still (Checkpoints::ReadCommitted): what the
// publisher (server/publish/) builds a version of weights from.
struct CommittedCopies {
  std::string group;
  std::string module;
  int32_t world_size = 0;
  Plan plan;
  Manifest manifest;
  std::vector<int32_t> ranks;  // the local ranks, ascending
  // By position in `ranks`, then by plan unit index: host memory (GPU ranks' device copies
  // were copied to host buffers first). Null where the rank holds no copy of the unit.
  std::vector<std::vector<std::shared_ptr<Buffer>>> by_unit;
  uint64_t generation = 0;
  int64_t owner_uid = -1;  // the group's
  // Multi-daemon groups: the other daemons' peer addresses (they hold the other ranks'
  // copies) and the group's token; empty otherwise.
  std::vector<std::string> peers;
  std::string token;
};

class Checkpoints {
 public:
  explicit Checkpoints(CheckpointsOptions options);
  Checkpoints(const Checkpoints&) = delete;
  Checkpoints& operator=(const Checkpoints&) = delete;

  // GroupManager::SaveCheckpoint and LoadCheckpoint (documented there).
  absl::StatusOr<CheckpointResult> SaveCheckpoint(const CheckpointArgs& args,
                                                  CheckpointProgress* progress);
  absl::StatusOr<CheckpointResult> LoadCheckpoint(const CheckpointArgs& args,
                                                  CheckpointProgress* progress);
  // Calls `read` with the committed copies of every rank of `args.module`, held still (no
  // commit copies into them meanwhile; commits that land wait), on this thread. Multi-daemon
  // groups: this daemon's ranks only (CommittedCopies::peers hold the others); args.from_peer
  // with the group's token for another daemon's request. Errors: the hold's (as
  // SaveCheckpoint's: NOT_FOUND, PERMISSION_DENIED, DEADLINE_EXCEEDED while copies do not come
  // to rest within args.wait); `read`'s error.
  absl::Status ReadCommitted(const CheckpointArgs& args,
                             const std::function<absl::Status(const CommittedCopies&)>& read);

 private:
  // The committed shards of a module held still for a save or a load.
  struct CheckpointHold;
  absl::StatusOr<CheckpointHold> HoldForCheckpoint(const CheckpointArgs& args, bool load,
                                                   CheckpointProgress* progress);
  // Why `reg` of `g` cannot be held for `args` now (access, formation, open summons, state
  // registered on some ranks only); fills `peers` with the other daemons' peer addresses.
  absl::Status CheckHoldableLocked(Group& g, const CheckpointArgs& args, bool load, Registered& reg,
                                   std::vector<std::string>* peers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Takes the hold on `reg`'s committed copies (at rest, at `generation`).
  CheckpointHold HoldLocked(Group& g, const std::string& module, Registered& reg, bool load,
                            uint64_t generation, std::vector<std::string> peers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // GPU ranks: host staging buffers of `buffers`' sizes (filled from them when `copy_in`);
  // host ranks: `buffers` themselves. Blocking on the device: not on a reactor thread.
  absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> HostCopies(
      int32_t rank, const std::vector<std::shared_ptr<Buffer>>& buffers, bool copy_in) const;
  // Ends a hold; a load sets `generation` and marks the local ranks stale.
  void ReleaseCheckpointHold(const CheckpointHold& hold, bool load,
                             std::optional<uint64_t> generation);
  // A load of a checkpoint with optimizer state into a module without any: allocates the
  // state buffers (and committed copies) of `specs` for the hold's ranks into `hold`; once
  // they hold the loaded values, InstallLoadedState installs them in the module (README
  // "Checkpoints"), so a load that fails leaves the module without state, as it was.
  absl::Status AllocateStateForLoad(CheckpointHold& hold, const std::vector<StateSpec>& specs);
  absl::Status InstallLoadedState(const CheckpointHold& hold);
  // SaveCheckpoint's steps (server/checkpoint/save.cc): one local rank's file of the held
  // committed copies, and the metadata of every daemon's files (checked complete).
  absl::StatusOr<checkpoint::WrittenFile> WriteRank(size_t i, const CheckpointArgs& args,
                                                    const CheckpointHold& hold,
                                                    CheckpointProgress* progress) const;
  static absl::StatusOr<checkpoint::Metadata> MetadataOf(const CheckpointHold& hold,
                                                         CheckpointResult result);
  // LoadCheckpoint's steps (server/checkpoint/load.cc): what is read, how the optimizer state
  // is loaded (checked and prepared before any shard changes), the checksums not checked while
  // reading, the bytes a load reports, and one local rank's fill of its committed copies
  // (the staging area): one pass over its file under the saved plan, else by FQN.
  struct LoadSource;
  struct StateLoad;
  static absl::Status OpenLoadSource(const CheckpointArgs& args, LoadSource* src);
  absl::Status PlanStateLoad(const CheckpointArgs& args, CheckpointHold& hold,
                             const LoadSource& src, StateLoad* state);
  static absl::Status PrepareStateReshard(const CheckpointArgs& args, const CheckpointHold& hold,
                                          const LoadSource& src, StateLoad* state);
  static absl::Status VerifyOtherFiles(const CheckpointHold& hold, LoadSource* src,
                                       CheckpointProgress* progress);
  static int64_t LoadBytes(const CheckpointHold& hold, const LoadSource& src,
                           const StateLoad& state);
  absl::Status FillRank(size_t i, const CheckpointArgs& args, const CheckpointHold& hold,
                        const LoadSource& src, const StateLoad& state,
                        CheckpointProgress* progress) const;
  static absl::Status ReadSavedLayout(const CheckpointArgs& args, const CheckpointHold& hold,
                                      size_t i, const LoadSource& src, const StateLoad& state,
                                      const std::vector<std::shared_ptr<Buffer>>& host,
                                      const std::vector<std::shared_ptr<Buffer>>& host_state,
                                      CheckpointProgress* progress);
  static absl::Status FillResharded(const CheckpointHold& hold, size_t i, const LoadSource& src,
                                    const StateLoad& state,
                                    const std::vector<std::shared_ptr<Buffer>>& host,
                                    const std::vector<std::shared_ptr<Buffer>>& host_state,
                                    CheckpointProgress* progress);
  // Multi-daemon groups: every other daemon's part of `hold`'s checkpoint, asked in parallel.
  std::vector<absl::StatusOr<CheckpointResult>> AskPeers(const CheckpointHold& hold,
                                                         const CheckpointArgs& args, bool load);

  ShardStore* const store_;
  RankDevices& devices_;
  GroupTable& table_;
  Modules& modules_;
  Records& records_;
  const std::atomic<bool>& shutdown_;
  CheckpointPeerClient* const peers_;
  const std::string self_peer_address_;
};

}  // namespace flatshard::server
