#pragma once
// The daemon's state directory (--state_dir; README "Restarts"): one record per group that
// holds durable state (an initialised module), so that a daemon restarting after kill -9,
// SIGTERM, an OOM kill or an upgrade finds the shared-memory segments of its shards, gradient
// shards and committed copies again and re-adopts them (GroupManager::AdoptGroups).
//
// A group's record is a base file, "group-<sha256(group id)[0:32]>.json" (the name never
// depends on what the id contains), and a journal beside it, "group-<...>.journal"
// (journal.h). The base is written crash-consistently by WriteFileAtomically
// (common/file_system.h): a temp file ".tmp.<name>.<pid>.<n>" in the same directory, write,
// fsync, rename over the record, fsync of the directory, so a reader sees the old base or the
// new one, never a mix. A write of some modules (WriteModules: a commit's intent or its end)
// appends one frame with just those modules to the journal and fsyncs it once: its cost is
// O(what changed), whatever the number of modules. When the journal outgrows the base (or a
// whole group is written, or a torn frame was found), the base is rewritten with everything
// and the journal starts over (compaction). The directory is 0700 and the files 0600: records
// hold group tokens. All file access goes through a FileSystem, so unit tests run it on
// InMemoryFileSystem.
//
// Base file format (flatshard.state/4; /3, read too, is the same without "deferred"; /2 also
// without "kept"; /1 also without a journal): a header line, then the body:
//   {"format":"flatshard.state/4","body_bytes":N,"body_sha256":"<hex>"}\n<body: N bytes of JSON>
// The checksum covers the body's exact bytes. LoadAll refuses a record whose header, size,
// checksum or body does not check out, naming the file and the check. A torn last journal
// frame (a kill mid-append) is ignored, with every frame before it applied.
//
// Buffers are listed generically per rank and unit, as {"role", "segment", "bytes"}: "shard",
// "grad", "committed", "host_committed" (GPU daemons at SIGTERM), and for optimizer state
// "state:<name>", "committed_state:<name>" and "host_committed_state:<name>", with the
// module's "state_specs" (optional: records written without it load with no state).
//
// Thread-safe. Writes are ordered by their `sequence` (taken where the snapshot was, under
// the caller's lock), per part of the record: the group's fields and each module. A write
// changes only the parts it is newer for than the last write (or removal) of that part, so a
// stale snapshot never overwrites a newer one, and a whole-group snapshot taken before a
// module's commit was recorded keeps that commit.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"
#include "common/json_util.h"
#include "common/state_spec.h"

namespace flatshard::server::state {

// What this daemon writes: a base whose journal (journal.h) holds the later writes, whose module
// records may list kept summon buffers ("kept") and copies into committed copies still to
// finish from a summon buffer ("deferred"). A daemon from before the journal refuses it
// (reading the base alone would adopt an older state), and so does one from before "kept"
// or "deferred" (adopting without finishing a deferred copy would adopt a torn one).
inline constexpr char kStateFormat[] = "flatshard.state/4";
// Read too: a journaled base from before "deferred" (its modules list none).
inline constexpr char kStateFormatV3[] = "flatshard.state/3";
// Read too: a journaled base from before "kept" (its modules list none).
inline constexpr char kStateFormatV2[] = "flatshard.state/2";
// Read too: a base written whole at every change, by a daemon from before the journal.
inline constexpr char kStateFormatV1[] = "flatshard.state/1";

// Roles of the durable buffers of a rank's unit.
inline constexpr char kRoleShard[] = "shard";
inline constexpr char kRoleGrad[] = "grad";
inline constexpr char kRoleCommitted[] = "committed";
// GPU daemons: a host copy of a device committed copy, made at SIGTERM with --keep_shards
// (GroupManager::KeepDeviceShards); the next daemon copies it into fresh device memory.
inline constexpr char kRoleHostCommitted[] = "host_committed";
// Optimizer state (RegisterState), one pair per StateSpec: "state:<name>" (the live buffer,
// UnitShard::state[i]) and "committed_state:<name>" (its committed copy). GPU daemons: a host
// copy of a device committed state buffer made at SIGTERM, "host_committed_state:<name>".
inline constexpr char kRoleStatePrefix[] = "state:";
inline constexpr char kRoleCommittedStatePrefix[] = "committed_state:";
inline constexpr char kRoleHostCommittedStatePrefix[] = "host_committed_state:";

struct BufferRecord {
  std::string role;     // kRole* or another branch's role ("state:exp_avg", ...)
  std::string segment;  // the shm name, with its leading "/"
  int64_t bytes = 0;
  friend bool operator==(const BufferRecord&, const BufferRecord&) = default;
};

struct UnitRecord {
  int32_t unit = 0;
  std::vector<BufferRecord> buffers;
  friend bool operator==(const UnitRecord&, const UnitRecord&) = default;
};

struct RankRecord {
  int32_t rank = 0;
  uint64_t generation = 0;  // the generation its committed copies hold
  std::vector<UnitRecord> units;
  friend bool operator==(const RankRecord&, const RankRecord&) = default;
};

// A commit (or an agreed writeback End, or an initialisation) every rank agreed to and whose
// copies into the committed copies were under way (GroupManager: "A torn commit is never
// adopted").
struct PendingCommit {
  uint64_t generation = 0;  // the generation being committed
  std::string kind;         // "commit", "end", "init" or "load" (a checkpoint load's copies)
  // Local ranks whose shards hold `generation` completely (their copy into the committed copy
  // may have begun: that copy may be torn).
  std::vector<int32_t> ready_ranks;
  // Local ranks whose committed copy holds `generation` completely.
  std::vector<int32_t> done_ranks;
  friend bool operator==(const PendingCommit&, const PendingCommit&) = default;
};

// A host buffer a module's summons keep (KeptBuffers: unsharded and staging buffers), recorded
// so that a restart after kill -9 adopts its segment, pages and all, instead of the first
// summon allocating and faulting in a fresh one (JSON "kept": [{"owner","rank","unit","use",
// "kind","segment","bytes"}], absent when empty; KeptKey's and BufferKind's values).
struct KeptRecord {
  int32_t owner = 0;
  int32_t rank = -1;
  int32_t unit = 0;
  int32_t use = 0;
  int32_t kind = 0;
  std::string segment;
  int64_t bytes = 0;
  friend bool operator==(const KeptRecord&, const KeptRecord&) = default;
};

// Part of a rank's committed copy that a writeback End left to copy after it answered
// (pending_committed.h): the committed copy of (`rank`, `unit`) holds generation `generation`
// completely once `bytes` bytes at `dst_offset` are copied from the summon buffer in `segment`
// (shm name, `segment_bytes` long, BufferKind `kind`) at `src_offset`. The End's trainer may
// step its shard in place, so only that segment holds those bytes: a restart copies them
// before it adopts the rank at `generation` (superseded, and skipped, when the rank's recorded
// generation is another one), and names the module lost when the segment is gone or resized.
// The daemon keeps the segment, never handed to another summon, until a record without the
// entry is written. JSON "deferred": [{"rank","unit","generation","segment","kind",
// "segment_bytes","src_offset","dst_offset","bytes"}], absent when empty.
struct DeferredRecord {
  int32_t rank = 0;
  int32_t unit = 0;
  uint64_t generation = 0;
  std::string segment;
  int32_t kind = 0;
  int64_t segment_bytes = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t bytes = 0;
  friend bool operator==(const DeferredRecord&, const DeferredRecord&) = default;
};

struct ModuleRecord {
  std::string name;           // the registered path
  std::string plan_json;      // PlanToJson, dumped
  std::string manifest_json;  // ManifestToJson, dumped
  bool initialized = false;
  std::optional<PendingCommit> pending;
  // The generation of a Commit this daemon's ranks voted for (their shards hold it) whose
  // outcome they had not learnt (Registered::voted_commit; JSON "voted", absent when 0):
  // a restart may roll them forward to it when another daemon holds it (commit_votes.cc).
  uint64_t voted = 0;
  std::vector<RankRecord> ranks;  // the local ranks holding shards, ascending
  // The module's optimizer state spec (Registered::state_specs; JSON "state_specs":
  // [{"name","dtype","shape"}], shape "shard" or "scalar"); empty: no state registered.
  // Records written before state was recorded have no key: they load with none.
  std::vector<StateSpec> state_specs;
  std::vector<KeptRecord> kept;          // KeptRecord; records without the key load with none
  std::vector<DeferredRecord> deferred;  // DeferredRecord; records without the key: none
  friend bool operator==(const ModuleRecord&, const ModuleRecord&) = default;
};

struct GroupRecord {
  std::string id;
  int32_t world_size = 0;
  std::string token;
  int64_t owner_uid = -1;
  std::string coordinator;
  std::vector<int32_t> local_ranks;
  uint64_t epoch = 0;
  uint64_t sequence = 0;  // orders the writes of one group (see above)
  std::vector<ModuleRecord> modules;
  friend bool operator==(const GroupRecord&, const GroupRecord&) = default;
};

// The file's bytes (header line + body).
std::string EncodeGroupRecord(const GroupRecord& record);
// Parses and checks a record file's bytes. INVALID_ARGUMENT naming the failed check
// ("header: ...", "checksum: ...", "body: $.modules[0].ranks: ...").
// `journaled` (optional): whether the format says a journal goes with it (/2; /1 has none).
absl::StatusOr<GroupRecord> DecodeGroupRecord(const std::string& bytes, bool* journaled = nullptr);

// "group-<hex>.json".
std::string RecordFileName(const std::string& group);

// The pieces of a record's body, for the journal (journal.h): one module as in "modules",
// and the group's fields but "sequence" and "modules". Decoding errors name `path`.
std::string EncodeModuleJson(const ModuleRecord& module);
absl::StatusOr<ModuleRecord> DecodeModuleJson(const Json& v, const JsonPath& path);
std::string EncodeGroupFieldsJson(const GroupRecord& record);
// Sets `record`'s fields but `sequence` and `modules` from `v`.
absl::Status DecodeGroupFieldsJson(const Json& v, const JsonPath& path, GroupRecord* record);

// A frame of a group's journal (journal.h).
struct JournalFrame {
  uint64_t base = 0;               // the sequence of the base record it applies to
  uint64_t sequence = 0;           // the write's
  GroupRecord group;               // the group's fields; its `modules` are put in place (by name)
  std::vector<std::string> drops;  // modules removed
};

// Applies `frame` to `record`: its fields, its modules in place of those of their names
// (the modules stay sorted by name, as a group's are), its drops removed.
void ApplyFrame(const JournalFrame& frame, GroupRecord* record);

class StateDir {
 public:
  // Creates `path` (and parents) if needed, mode 0700, and removes temp files a killed writer
  // left. FAILED_PRECONDITION naming the path when it cannot be made or is not a directory.
  // `sync`: fsync each record and the directory (the default; AtomicWriteOptions::sync).
  // `fs`: where the records live (tests: an InMemoryFileSystem); must outlive the StateDir.
  static absl::StatusOr<std::unique_ptr<StateDir>> Open(const std::string& path, bool sync = true,
                                                        FileSystem* fs = FileSystem::Posix());

  const std::string& path() const { return path_; }

  // Writes the whole group `record` (its fields and the modules it lists; modules it does not
  // list are dropped), each part unless a write or removal with a higher or equal sequence
  // already happened for it (OK, nothing written when no part is newer). Rewrites the base.
  // On error (INTERNAL, or the file system's code; the message names the record's file and
  // the failed call) the group's previous record is unchanged, and a retry with the same
  // sequence writes it.
  absl::Status Write(const GroupRecord& record) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes the group's fields and the modules named in `touched`: those in `record.modules`
  // are put in place, the others dropped (a group left with no module is removed). Same
  // ordering and errors as Write; one journal append and one fsync, unless the journal is due
  // for compaction or the group has no record yet (then the base is written).
  // `sync` false: the append is written (it survives the daemon's death, as the page cache
  // outlives the process) but not fsynced (a machine crash may lose it; the shared-memory
  // shards it describes die with the machine too).
  absl::Status WriteModules(const GroupRecord& record, const std::vector<std::string>& touched,
                            bool sync = true) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the group's record (OK when there is none), unless a later write happened.
  absl::Status Remove(const std::string& group, uint64_t sequence) ABSL_LOCKS_EXCLUDED(mu_);

  struct Refused {
    std::string file;  // full path
    std::string why;   // the failed check
  };
  struct Loaded {
    std::vector<GroupRecord> groups;
    std::vector<Refused> refused;
  };
  // Every record of the directory (base and journal), checked. Sequences go on above the
  // highest loaded.
  Loaded LoadAll() ABSL_LOCKS_EXCLUDED(mu_);

  // The shared-memory segments (with their leading "/") that a daemon starting on `loaded`
  // must keep: every buffer of the loaded groups, and every name with `prefix` in a refused
  // record (read again here; its segments are left alone rather than removed as garbage,
  // and each refused record is logged with them).
  std::vector<std::string> SegmentsNamedBy(const Loaded& loaded, const std::string& prefix);

  // What the daemon writes next must be above every loaded sequence.
  uint64_t max_loaded_sequence() const { return max_loaded_sequence_; }

  // A journal larger than this and than its base is compacted into a new base: a commit costs
  // O(what changed) amortized, the base's rewrite spread over as many bytes of frames, and
  // small groups rewrite their base rarely (a compaction is the slow write a p99 sees).
  static constexpr int64_t kMinCompactBytes = int64_t{4} << 20;
  // Tests: a smaller threshold, to see compactions without megabytes of frames.
  void SetMinCompactBytes(int64_t bytes) { min_compact_bytes_ = bytes; }

 private:
  StateDir(std::string path, bool sync, FileSystem* fs)
      : path_(std::move(path)), sync_(sync), fs_(fs) {}
  struct PerGroup {
    absl::Mutex mu;        // serializes the writes of one group (held across the fsync: ours only)
    uint64_t last = 0;     // the highest sequence written or removed
    uint64_t removed = 0;  // of the last removal: writes at or below it are stale
    uint64_t whole = 0;    // of the last Write: module writes at or below it are stale
    uint64_t fields = 0;   // of the last write of the group's fields
    std::map<std::string, uint64_t> modules;  // of the last write of each module (or drop)
    // What the disk holds (base and journal); none: no record.
    std::optional<GroupRecord> current;
    uint64_t base = 0;  // the base's sequence (the journal's frames name it)
    int64_t base_bytes = 0;
    int64_t journal_bytes = 0;
    // The journal holds frames of `base` only, none torn: appending is safe.
    bool journal_clean = false;
    std::unique_ptr<WritableFile> journal;  // open for appending when journal_clean
  };
  // Appends `frame` (the group's fields and the modules it changes) to the journal and
  // fsyncs once; or, when the group has no record yet, the journal is not clean or it is due
  // for compaction, writes a new base with the frame applied. REQUIRES: g.mu held.
  absl::Status Append(PerGroup& g, JournalFrame frame, bool sync);
  absl::Status RewriteBase(PerGroup& g, GroupRecord merged);
  absl::Status RemoveFiles(PerGroup& g, const std::string& group);
  std::shared_ptr<PerGroup> GroupState(const std::string& group) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;
  const bool sync_;
  FileSystem* const fs_;
  uint64_t max_loaded_sequence_ = 0;
  std::atomic<int64_t> min_compact_bytes_{kMinCompactBytes};
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<PerGroup>> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server::state

namespace flatshard::server::state {

// Shared-memory names ("/<prefix>.<...>") that occur in `bytes` (a record, also one that
// failed its checks: its segments are left alone rather than removed as garbage).
std::vector<std::string> SegmentNamesIn(const std::string& bytes, const std::string& prefix);

// Startup cleanup with a state directory (instead of UnlinkSegmentsWithPrefix): removes every
// /dev/shm entry "<prefix>.<pid>.<n>" whose pid is this process or a dead one, except the
// names in `keep` (with their leading "/"), and logs each one removed (name, bytes).
absl::Status UnlinkUnreferencedSegments(const std::string& prefix,
                                        const std::vector<std::string>& keep);

}  // namespace flatshard::server::state
