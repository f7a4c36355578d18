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
// The records' format and their codec: record_codec.h. LoadAll refuses a record that does not
// check out, naming the file and the check, and ignores a torn last journal frame (a kill
// mid-append), with every frame before it applied.
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
#include "server/durable/record_codec.h"

namespace flatshard::server::state {

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

// Startup cleanup with a state directory (instead of UnlinkSegmentsWithPrefix): removes every
// /dev/shm entry "<prefix>.<pid>.<n>" whose pid is this process or a dead one, except the
// names in `keep` (with their leading "/"), and logs each one removed (name, bytes).
absl::Status UnlinkUnreferencedSegments(const std::string& prefix,
                                        const std::vector<std::string>& keep);

}  // namespace flatshard::server::state
