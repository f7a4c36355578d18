#pragma once
// Publisher: the owner of published weights (README "Publishing weights", issue 25).
//
// A training group publishes the committed step of a registered module as version V of a
// name (Publish, collective over the group's ranks). Readers that are no members of any group
// (inference engines) open a version (Open: a lease) or watch for new ones (Watch).
//
// Design:
// - Names are scoped by the publisher's uid (the group's): the key is (owner_uid, name).
//   Version numbers start at 1 and increase per key; they are never reused (dropped and freed
//   numbers included; across restarts only with a state directory).
// - Restarts: with a state directory, the newest version of each key is written to
//   `<state_dir>/weights/` (weights_files.h) by the worker right after Publish is answered
//   (the write costs far more than the copy; the next publish waits for it), or by the
//   puller after a copy from --weights_sources (StoreNewest), and adopted at start
//   (numbering goes on after it). Without one, versions do not survive a
//   restart and readers get NOT_FOUND saying so.
// - A version is built from the committed copies (Checkpoints::ReadCommitted holds them still,
//   so commits that land meanwhile wait and trainers that go on training change nothing):
//   every parameter whole, padding dropped, in the unwrapped module's state_dict layout, cast
//   if asked (weights_layout.h), into ONE new host segment (a kStaging buffer of the store,
//   allocated for the owner uid, so the bytes count against that uid's quota and the daemon's
//   memory limit). Sealed read-only (mode 0400) and only then inserted in the table: readers
//   see all of it or nothing; a publisher or daemon killed before the insert leaves nothing.
// - Groups whose ranks join through several daemons (distributed_publish.h): each daemon's
//   batch is its own ranks; rank 0's daemon (the leader) builds the version from its copies
//   and the other daemons' (WeightsPeerService.ReadShards, once they hold publish `seq`), and
//   every other daemon copies that version (FetchVersion) and inserts it under the leader's
//   number and generation. A version exists on a daemon only once complete there.
// - Versions copied from another daemon (AddCopy: the multi-daemon followers, a reader's
//   daemon pulling from --weights_sources, weights_puller.h) keep the source's number.
// - Access: the owner uid, the uids the publisher granted and callers presenting the granted
//   token may open a version; admin callers (root, the daemon's uid) may list, inspect and
//   drop everything. A reader of another uid is added to the segment's ACL when admitted
//   (segment_grant.h); its mapping is O_RDONLY and PROT_READ.
// - Bounds: the newest `keep` versions of each key stay, plus any version a lease holds; the
//   rest are removed from the table at once and freed when their last lease ends. Drop removes
//   versions the same way. A version that leaves with no lease on it becomes the spare segment
//   of its name (spare_segments.h): the next version of that name is copied into it, memory
//   already backed and mapped, at about memcpy speed (a fresh segment's page faults cost 20x
//   the copy on the VMs measured). Readers must not read a version past its lease.
// - GPU daemons (PublishArgs::device, device_versions.h): a version may be placed in device
//   memory of one of the daemon's GPUs instead (filled on the host, then copied once), read
//   through CUDA IPC by the owner uid only; such versions are never stored, copied to readers'
//   daemons or reused as spares, and do not survive a restart. Multi-daemon groups: the leader
//   keeps the filled host buffer (Version::peer_copy) beside its device copy, the group's other
//   daemons copy it (Export with group_peer) and each uploads it to its own GPU; the host copy
//   goes when a newer version of the name is inserted or the version leaves. A daemon without
//   the GPU refuses the batch through PublishRounds, so the leader fails the publish everywhere.
//
// Thread safety: thread-safe. One lock (mu_), a leaf: never held across a copy, an allocation,
// a group's lock, a callback or gRPC. Builds run on the publisher's own worker thread (never
// on a gRPC reactor); callbacks run on that thread or the caller's, never under mu_.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/rpc_types.h"
#include "server/publish/device_versions.h"
#include "server/publish/spare_segments.h"
#include "server/publish/weights_files.h"
#include "server/publish/weights_layout.h"

namespace flatshard::server {

class Buffer;
class GroupManager;
class ShardStore;

// One version as List, Watch and Publish report it.
struct WeightsInfo {
  std::string name;
  int64_t owner_uid = -1;
  uint64_t version = 0;
  uint64_t generation = 0;
  int64_t bytes = 0;
  int32_t tensors = 0;
  int32_t readers = 0;  // open leases now
  std::string group;
  std::string module;
  int32_t device = -1;  // the daemon's GPU holding it; -1: host shared memory
};

// What a reader maps: the segment (device versions: the pool slab, opened through CUDA IPC
// with `ipc_handle` on `device_uuid`, the version `offset` bytes into it) and the index.
struct WeightsDescriptor {
  WeightsInfo info;
  std::string segment;
  int64_t segment_bytes = 0;
  std::vector<WeightsEntry> tensors;
  std::string ipc_handle;
  std::string device_uuid;
  int64_t offset = 0;
};

// Which version a reader means.
struct WeightsSelector {
  std::string name;
  int64_t owner_uid = -2;  // -2: the caller's own uid
  uint64_t version = 0;    // 0: the latest
  std::string token;
  // A daemon of the version's group copying the version the leader built (FetchVersion with
  // a seq): a device version then gives the host copy kept for those daemons (Export).
  bool group_peer = false;
};

struct PublishArgs {
  Caller caller;  // with its uid
  std::string module;
  std::string name;
  std::optional<DType> dtype;
  std::vector<int64_t> reader_uids;
  std::string reader_token;
  int device = -1;  // >= 0: into device memory of the daemon's GPU with this ordinal
  absl::Time deadline = absl::InfiniteFuture();  // for the other ranks' arrivals
};

// A Watch's receiver (the service's stream). Deliver runs on the publisher's threads, never
// under its lock, possibly after the watch was removed (it must then do nothing). End comes
// once, from Shutdown (outside the lock): the stream ends now with `why` (UNAVAILABLE), so a
// stopping daemon does not wait its grace for watchers.
class WeightsWatcher {
 public:
  virtual ~WeightsWatcher() = default;
  virtual void Deliver(const WeightsInfo& version) = 0;
  virtual void End(const absl::Status& why) = 0;
};

// An open lease's stream (the service's OpenWeights call). End comes at most once, from
// Shutdown (outside the lock): the stream ends now with `why` (UNAVAILABLE), so a stopping
// daemon does not wait its grace for readers. The lease stays until Release; the reader's
// mapping stays valid (the segment is its until it unmaps).
class WeightsLeaseHolder {
 public:
  virtual ~WeightsLeaseHolder() = default;
  virtual void End(const absl::Status& why) = 0;
};

// A whole version copied from another daemon (weights_peer_client.h); its number and
// generation are the source's. The buffer is filled, not yet sealed.
struct CopiedVersion {
  WeightsInfo info;
  std::shared_ptr<Buffer> buffer;
  WeightsLayout layout;
  std::vector<int64_t> reader_uids;
  std::string token;
};

// A version held for sending to another daemon: `data` stays valid while `hold` lives.
struct ExportedVersion {
  WeightsDescriptor descriptor;
  std::vector<int64_t> reader_uids;
  std::string token;
  const char* data = nullptr;
  std::shared_ptr<const void> hold;
};

class DistributedPublish;
class PublishRounds;

struct PublisherOptions {
  ShardStore* store = nullptr;
  GroupManager* groups = nullptr;
  int keep = 2;             // --weights_keep: newest versions kept per name
  int fill_threads = 4;     // threads copying one version
  int64_t daemon_uid = -1;  // admin callers: this uid and root
  // Where the newest version of each name is kept across restarts ("<state_dir>/weights");
  // empty: nowhere.
  std::string files_dir;
  // Multi-daemon groups (the daemon's peer channels); null: such groups are refused.
  DistributedPublish* distributed = nullptr;
  // The daemon's GPUs (device versions); empty: host versions only.
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus;
};

class Publisher {
 public:
  explicit Publisher(PublisherOptions options);
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;
  // Shutdown(), then frees the table (leases' mappings in readers stay valid).
  ~Publisher();

  // With options.files_dir: takes back the versions a previous daemon stored there (files
  // that do not check out, or do not fit the store, are logged and skipped). Call once,
  // before serving. Returns how many were adopted.
  int Adopt();

  // "--weights_keep must be >= 1" and friends; OK otherwise.
  static absl::Status ValidateOptions(const PublisherOptions& options);

  using PublishDone = absl::AnyInvocable<void(absl::StatusOr<WeightsInfo>)>;
  // One rank's arrival at a collective publish; `done` runs once (on the worker thread or
  // here) when every rank of the group arrived and the version is in the table, or with the
  // error: INVALID_ARGUMENT (a bad name or dtype; ranks that disagree, naming the rank and the
  // field; DeviceVersions::Check's), CheckCaller's errors, FAILED_PRECONDITION (nothing
  // committed; a multi-daemon group on a daemon without peer channels; a GPU the daemon does
  // not use: multi-daemon groups on every daemon, naming the daemon that lacks it),
  // RESOURCE_EXHAUSTED (quota or memory limit: uid, quota, usage), DEADLINE_EXCEEDED naming
  // the ranks that did not arrive by args.deadline, UNAVAILABLE after Shutdown.
  void Publish(PublishArgs args, PublishDone done);

  // Admits `uid` to the selected version and takes a lease on it (`*lease`): the version is
  // not freed before Release(*lease). `holder` (may be null) is told when Shutdown ends the
  // lease's stream. NOT_FOUND naming the owner uid, name and version (and the versions there
  // are); PERMISSION_DENIED naming the uid when it is not granted; UNAVAILABLE after Shutdown.
  absl::StatusOr<WeightsDescriptor> Open(const WeightsSelector& selector, int64_t uid,
                                         uint64_t* lease,
                                         std::shared_ptr<WeightsLeaseHolder> holder = nullptr);
  // Ends a lease; the version is freed once no lease holds it and it is not kept. Idempotent.
  void Release(uint64_t lease);

  // Watches the selected key (selector.version is ignored): `watcher` receives the newest
  // version newer than `after` now (if any, before this returns) and each later one newer
  // than every one it received (copies from other daemons may arrive out of order), but only
  // versions `uid` (or selector.token) may open, so a key may be watched before its first
  // version exists. Returns the watch's id for Unwatch. UNAVAILABLE after Shutdown (which
  // ends every watch: WeightsWatcher::End).
  absl::StatusOr<uint64_t> Watch(const WeightsSelector& selector, int64_t uid, uint64_t after,
                                 std::shared_ptr<WeightsWatcher> watcher);
  void Unwatch(uint64_t id);

  // The versions `uid` may open (all for admin callers) of `name` (empty: all names).
  std::vector<WeightsInfo> List(int64_t uid, const std::string& name) const;
  // The selected version's descriptor, without a lease. Errors as Open.
  absl::StatusOr<WeightsDescriptor> Inspect(const WeightsSelector& selector, int64_t uid) const;
  // Removes the selected version (selector.version 0: every version of the name) from the
  // table; the owner or an admin caller only (PERMISSION_DENIED). NOT_FOUND as Open. Returns
  // how many were removed.
  absl::StatusOr<int> Drop(const WeightsSelector& selector, int64_t uid);

  // Inserts a version copied from another daemon under its own number (seals it and grants
  // its reader uids first). A number this daemon has already is kept as it is (the copy is
  // dropped). Returns what is in the table. UNAVAILABLE after Shutdown. Not written to the
  // state directory here (the caller answers its readers first, then StoreNewest).
  absl::StatusOr<WeightsInfo> AddCopy(CopiedVersion copy);
  // The spare segment of `copy`'s name when it fits its size and grants (spare_segments.h),
  // for the copy's bytes to land in; null otherwise.
  std::shared_ptr<Buffer> TakeSpare(const CopiedVersion& copy);
  // Writes the newest version of (owner uid, name) to the state directory (when there is one
  // and a newer one is not stored already): blocking file I/O, never on a reactor. Logs
  // failures.
  void StoreNewest(int64_t owner_uid, const std::string& name);
  // The selected version held for another daemon, checked for reader `uid` (Open's errors;
  // FAILED_PRECONDITION for a device version: they are not copied to readers' daemons; for
  // selector.group_peer, its host copy while the leader keeps it).
  absl::StatusOr<ExportedVersion> Export(const WeightsSelector& selector, int64_t uid) const;
  // The newest version number of (owner uid, name) here; 0: none.
  uint64_t Newest(int64_t owner_uid, const std::string& name) const;

  // Fails pending arrivals and ends every watch and every lease's stream (UNAVAILABLE; the
  // leases themselves end at Release), then stops the worker. Idempotent.
  void Shutdown();

 private:
  using Key = std::pair<int64_t, std::string>;  // (owner uid, name)
  struct Version;
  struct Batch;
  struct Job;

  bool Admin(int64_t uid) const { return uid == 0 || uid == options_.daemon_uid; }
  // The selected version, checked for `uid`. REQUIRES: mu_.
  absl::StatusOr<std::shared_ptr<Version>> FindLocked(const WeightsSelector& selector,
                                                      int64_t uid) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  static absl::Status CheckReader(const Version& v, int64_t uid, const std::string& token,
                                  bool admin);
  // Drops what falls out of the newest `keep` of `key` and holds no lease into `freed`.
  void TrimLocked(const Key& key, std::vector<std::shared_ptr<Version>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker: builds complete batches, fails expired ones.
  void Run();
  void Build(Job job);
  absl::StatusOr<std::shared_ptr<Version>> MakeVersion(const Job& job);
  // A copy of the filled `host` version in GPU a.device's memory (errors name the publish).
  absl::StatusOr<std::shared_ptr<Buffer>> ToDevice(const Buffer& host, const PublishArgs& a,
                                                   int64_t owner_uid,
                                                   const std::string& group) const;
  // Hands what `freed` solely owns to spares_ (after mu_), and frees the rest.
  void Recycle(std::vector<std::shared_ptr<Version>>* freed);
  // A copied version sealed read-only with its reader uids granted, ready to insert.
  static absl::StatusOr<std::shared_ptr<Version>> FromCopy(CopiedVersion copy);
  // Inserts a complete sealed version (number v->info.version, or the next one when 0), trims,
  // and collects the watchers to tell. REQUIRES: mu_.
  void InsertLocked(const std::shared_ptr<Version>& v, std::vector<std::shared_ptr<Version>>* freed,
                    std::vector<std::pair<std::shared_ptr<WeightsWatcher>, WeightsInfo>>* notify)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `v` to the state directory (when there is one, and no newer version of its key is
  // stored); logs failures.
  void Store(const Version& v) ABSL_LOCKS_EXCLUDED(files_mu_);

  const PublisherOptions options_;
  // The state directory's files: writes by the worker and the pullers' threads, removals
  // by Drop, serialized by files_mu_ (never held with mu_).
  absl::Mutex files_mu_;
  WeightsFiles files_;
  std::map<Key, uint64_t> stored_ ABSL_GUARDED_BY(files_mu_);  // the version in each file
  const DeviceVersions devices_;
  SpareSegments spares_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<Key, std::map<uint64_t, std::shared_ptr<Version>>> table_ ABSL_GUARDED_BY(mu_);
  std::map<Key, uint64_t> last_version_ ABSL_GUARDED_BY(mu_);  // never reused
  std::map<uint64_t, std::shared_ptr<Version>> leases_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<WeightsLeaseHolder>> holders_ ABSL_GUARDED_BY(mu_);
  struct WatchEntry {
    Key key;
    int64_t uid = -1;
    std::string token;
    std::shared_ptr<WeightsWatcher> watcher;
    uint64_t after = 0;  // the newest version told of (or asked to be newer than)
  };
  std::map<uint64_t, WatchEntry> watches_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Arrivals by (group, module): one collective publish at a time per module.
  std::map<std::pair<std::string, std::string>, std::unique_ptr<Batch>> batches_
      ABSL_GUARDED_BY(mu_);
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);  // complete batches to build, in order
  std::thread worker_;                         // last: starts after everything it uses
};

}  // namespace flatshard::server
