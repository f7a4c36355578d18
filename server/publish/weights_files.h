#pragma once
// WeightsFiles: the newest published version of each (owner uid, name) in the state directory
// (`<state_dir>/weights/`, README "Publishing weights"), so that it survives a daemon restart.
// One file per key, "v-<uid>-<hex name>.weights": a header line (magic), one JSON line (the
// version's summary, grants and index), zero padding to 4 KiB, then the version's bytes.
// Written under a temp name, fsynced and renamed over the key's previous file (AtomicFile), so
// a daemon killed mid-write leaves the previous version's file; read back at start.
// Blocking file I/O: called from the publisher's worker, pullers and Adopt, never a reactor.
// Thread-compatible (the publisher serializes its calls with a lock of its own).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/publish/weights_layout.h"

namespace flatshard::server {

// What a file holds besides the bytes.
struct StoredWeights {
  std::string name;
  int64_t owner_uid = -1;
  uint64_t version = 0;
  uint64_t generation = 0;
  std::string group;
  std::string module;
  std::vector<int64_t> reader_uids;
  std::string token;
  WeightsLayout layout;
  std::string path;         // the file (List)
  int64_t data_offset = 0;  // where the bytes start in it (List)
};

class WeightsFiles {
 public:
  // `dir`: made (0700) on the first Write. Empty: nothing is stored.
  explicit WeightsFiles(std::string dir) : dir_(std::move(dir)) {}

  bool enabled() const { return !dir_.empty(); }
  // Stores `meta` and the layout.bytes at `data` as its key's file. Errors: the file
  // system's, naming the path.
  absl::Status Write(const StoredWeights& meta, const void* data);
  // Removes the key's file when it holds `version` (0: whatever it holds).
  void Remove(int64_t owner_uid, const std::string& name, uint64_t version);
  // Removes the temp files of writes a killed daemon left unfinished.
  void RemoveUnfinished();
  // Every stored version whose header parses; files that do not are logged and skipped.
  std::vector<StoredWeights> List() const;
  // Reads the bytes of `meta` (from List) into `dst` (layout.bytes bytes).
  static absl::Status ReadInto(const StoredWeights& meta, void* dst);

 private:
  std::string PathOf(int64_t owner_uid, const std::string& name) const;
  const std::string dir_;
};

}  // namespace flatshard::server
