#pragma once
// A group's journal: what changed in its record since the record file was last written, so
// that a commit's durability costs one append of the modules it changed and one fsync,
// whatever the number of modules (README "Restarts"; StateDir writes and reads it).
//
// The record file "group-<hex>.json" (record_codec.h) is the base; "group-<hex>.journal" beside
// it is a sequence of frames, each a header line and a body:
//   {"journal":"flatshard.journal/1","base":B,"sequence":S,"body_bytes":N,"body_sha256":"<hex>"}\n
//   {"group":{<the record's fields but "sequence" and "modules">},
//    "upsert":[<module, as in a record's "modules">...],"drop":["<module name>"...]}\n
// A frame applies to the base whose "sequence" is B (a journal left by a base that was since
// rewritten is stale and ignored as a whole): it replaces the group's fields, puts each
// "upsert" module in place of the one of its name, and removes each "drop". Frames apply in
// file order. A kill at any byte leaves a torn last frame (short, or failing its checksum):
// replay stops there, and every earlier frame is intact.
//
// Thread-safe: pure functions.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "server/durable/record_codec.h"

namespace flatshard::server::state {

inline constexpr char kJournalFormat[] = "flatshard.journal/1";

// "group-<hex>.journal", beside RecordFileName(group).
std::string JournalFileName(const std::string& group);

// The frame's bytes (header line, body, newline).
std::string EncodeJournalFrame(const JournalFrame& frame);

struct Replayed {
  GroupRecord record;  // the base with every applicable frame applied
  int applied = 0;     // frames applied
  int stale = 0;       // frames of another base, ignored
  // Why replay stopped before the end ("frame 3 at byte 4096: checksum: ..."); empty when
  // every byte was read. Nothing after it applies: a kill tore the last write.
  std::string torn;
  uint64_t max_sequence = 0;  // of the applied frames (0: none)
};

// Applies `bytes` (a journal) to `base`. INVALID_ARGUMENT naming the frame when a frame
// whose checksum holds does not decode as a frame of `base`'s group (not a torn write: the
// record as a whole is refused).
absl::StatusOr<Replayed> ReplayJournal(GroupRecord base, const std::string& bytes);

}  // namespace flatshard::server::state

namespace flatshard::server::state {

// The record of `group` in the state directory `dir` as a restarted daemon would load it:
// the base with its journal applied (tests, tools; StateDir::LoadAll for the daemon).
// NOT_FOUND when there is no base; INVALID_ARGUMENT naming the file and check otherwise.
absl::StatusOr<GroupRecord> ReadGroupRecord(FileSystem* fs, const std::string& dir,
                                            const std::string& group);

}  // namespace flatshard::server::state
