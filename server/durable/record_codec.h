#pragma once
// The record codec of the state directory (state_dir.h): the in-memory records of a group's
// durable state, their encoding into a record file's bytes and the strict decoding that
// checks every field, the journal's pieces (journal.h) and how a frame applies. No file I/O:
// pure functions, thread-safe; StateDir and the journal do the reading and writing.
//
// Base file format (flatshard.state/4; /3, read too, is the same without "deferred"; /2 also
// without "kept"; /1 also without a journal): a header line, then the body:
//   {"format":"flatshard.state/4","body_bytes":N,"body_sha256":"<hex>"}\n<body: N bytes of JSON>
// The checksum covers the body's exact bytes.
//
// Buffers are listed generically per rank and unit, as {"role", "segment", "bytes"}: "shard",
// "grad", "committed", "host_committed" (GPU daemons at SIGTERM), and for optimizer state
// "state:<name>", "committed_state:<name>" and "host_committed_state:<name>", with the
// module's "state_specs" (optional: records written without it load with no state).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// Sets `to`'s group fields (all but `sequence` and `modules`) from `from`.
void CopyGroupFields(const GroupRecord& from, GroupRecord* to);
// The module named `name` in `modules`; null when none is.
const ModuleRecord* FindModule(const std::vector<ModuleRecord>& modules, const std::string& name);

// Shared-memory names ("/<prefix>.<...>") that occur in `bytes` (a record, also one that
// failed its checks: its segments are left alone rather than removed as garbage).
std::vector<std::string> SegmentNamesIn(const std::string& bytes, const std::string& prefix);

}  // namespace flatshard::server::state
