#pragma once
// Checkpoints of registered modules: the `flatshard.checkpoint/1` directory format (README
// "Checkpoints"), its writer, reader and validation.
//
// A checkpoint is a directory:
//   rank-00003-of-00008.bin  one data file per rank of the group that saved it: that rank's
//                            committed shard of every unit (tensor name "shard"), and any other
//                            named per-(rank, unit) tensors (optimizer state), each at an
//                            offset aligned to kTensorAlignment, zero bytes in between;
//   metadata.json            written LAST: format, module, group, world size, generation, the
//                            plan (PlanToJson), the parameters (FQN, shape, dtype, unit, offset
//                            in the unit's flat buffer, tied aliases), per file its name, bytes
//                            and CRC-32C, per (rank, unit, tensor name) its offset, bytes, dtype.
// Every file is written to "<name>.tmp", fsynced, renamed, and the directory fsynced, so a crash
// leaves either the old file or the new one, never a torn one; the metadata file appears only
// once every data file is complete, so a directory without metadata.json is an incomplete
// checkpoint and is refused.
//
// Checksum: CRC-32C (Castagnoli) of each whole data file, computed while writing (SSE4.2 where
// the CPU has it: several GB/s, far above disk bandwidth; SHA-256 in common/sha256.h runs at a
// few hundred MB/s, which would cap a save below the disk's speed). It catches torn, truncated
// and bit-flipped files, not an adversary.
//
// Thread-safe: pure functions and immutable values; a Checkpoint may be read from many threads.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/json_util.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/state_spec.h"

namespace flatshard::checkpoint {

inline constexpr absl::string_view kFormat = "flatshard.checkpoint/1";
inline constexpr char kMetadataFile[] = "metadata.json";
// The tensor name of a rank's committed parameter shard of a unit.
inline constexpr char kShardTensor[] = "shard";
// Data offsets inside a rank file are multiples of this (page size: direct and mapped reads).
inline constexpr int64_t kTensorAlignment = 4096;

// CRC-32C of `n` bytes at `data`, continuing from `crc` (0 to start).
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);
// "rank-00003-of-00008.bin".
std::string RankFileName(int32_t rank, int32_t world_size);

struct TensorEntry {
  int32_t rank = 0;
  int32_t unit = 0;
  std::string name;  // kShardTensor, or an optimizer state's name ("exp_avg", ...)
  DType dtype = DType::kFloat32;
  int64_t offset = 0;  // bytes from the start of the rank's file
  int64_t bytes = 0;
};

struct FileEntry {
  std::string name;  // RankFileName(rank, world_size)
  int32_t rank = 0;
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct Metadata {
  std::string module;  // the registered module path ("" is the root)
  std::string group;
  int32_t world_size = 0;
  uint64_t generation = 0;  // the committed generation saved (the same on every rank)
  std::string created;      // RFC 3339 UTC time of the save
  Plan plan;
  std::vector<FileEntry> files;      // one per rank, by rank
  std::vector<TensorEntry> tensors;  // by (rank, unit, name)
  // Tied parameters the plan does not name: a parameter reachable at several paths whose
  // later paths lie in other units (FSDP flattens it into the first unit; the plan's
  // `shared` lists only aliases inside a unit). From the manifest (TiedAliases); export
  // writes them so its keys are exactly the unwrapped module's state_dict's.
  std::vector<SharedParam> tied;
  // The module's optimizer state specs (RegisterState) when the checkpoint holds its state:
  // then every (rank, unit) has one tensor per spec, named as the spec, of the spec's dtype and
  // StateSpec::Numel(unit.shard_numel) elements (a SHARD state has the layout of the rank's
  // flat shard). Empty: parameters only. JSON key "optimizer_state" (absent when empty).
  std::vector<StateSpec> state_specs;

  // The entry of (rank, unit, name); null when absent.
  const TensorEntry* FindTensor(int32_t rank, int32_t unit, absl::string_view name) const;
  int64_t total_bytes() const;
};

// The metadata document (keys in a fixed order). Besides the fields above it carries "params":
// every parameter's FQN, shape, dtype, unit, offset and aliases (derived from the plan, for
// readers without a plan parser, e.g. `flatshardctl checkpoint inspect`).
nlohmann::ordered_json MetadataToJson(const Metadata& meta);
// Parses and checks the document: format, types, the plan (PlanFromJson: self-consistent,
// fingerprint), one file per rank named as RankFileName, every (rank, unit) having its "shard"
// of exactly the unit's shard bytes, tensors inside their file and not overlapping.
// INVALID_ARGUMENT "<path>: <JSON path>: <what>".
absl::StatusOr<Metadata> MetadataFromJson(absl::string_view text, absl::string_view path);

// The paths of `manifest`'s parameters (every path of a tied or shared one, as
// named_parameters(remove_duplicate=False)) that `plan` names neither as a param nor as a
// shared alias nor as ignored, each with the plan param it is the same tensor as.
std::vector<SharedParam> TiedAliases(const flatshard::Manifest& manifest, const Plan& plan);

// ---- Writing ----

// One tensor of a rank's file. `data` is host memory (may be null only when bytes == 0).
struct TensorToWrite {
  int32_t unit = 0;
  std::string name;
  DType dtype = DType::kFloat32;
  const void* data = nullptr;
  int64_t bytes = 0;
};

struct WrittenFile {
  FileEntry file;
  std::vector<TensorEntry> tensors;
};

// Called with the bytes written since the last call (from the writing thread).
using ProgressFn = std::function<void(int64_t bytes)>;

// Writes `rank`'s data file into `dir` (which must exist) through an AtomicFile
// (common/file_system.h): "<name>.tmp", large sequential writes, CRC-32C on the way, fsync,
// rename. Does not fsync the directory (WriteMetadata does). Errors name the file and the
// system call; a failed write removes its "<name>.tmp".
absl::StatusOr<WrittenFile> WriteRankFile(const std::string& dir, int32_t rank, int32_t world_size,
                                          const std::vector<TensorToWrite>& tensors,
                                          const ProgressFn& progress = nullptr);
// Writes metadata.json last: fsync of the directory (the data files' renames), then
// WriteFileAtomically ("metadata.json.tmp", fsync, rename, fsync of the directory).
absl::Status WriteMetadata(const std::string& dir, const Metadata& meta);
// mkdir -p with mode 0755 (existing directories are fine).
absl::Status MakeDirs(const std::string& dir);

// ---- Reading ----

struct Checkpoint {
  std::string dir;
  Metadata meta;
};

// Reads and checks metadata.json and that every data file exists with its recorded size.
// Checksums are not read here (VerifyFiles). FAILED_PRECONDITION naming the file and the failed
// check: "<dir>/metadata.json: missing (an incomplete checkpoint: ...)", "<file>: 1000 bytes,
// the metadata says 4096 (truncated)".
absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir);
// Reads the data files of `ranks` (empty: all) whole and compares their CRC-32C with the
// metadata's (ReadRankFile without destinations), one thread per file (at most `threads`).
// DATA_LOSS naming the file:
// "<file>: CRC-32C 1a2b3c4d, the metadata says 5e6f7a8b (corrupt)".
absl::Status VerifyFiles(const Checkpoint& ckpt, const std::vector<int32_t>& ranks,
                         const ProgressFn& progress = nullptr, int threads = 8);
// Where ReadRankFile puts one tensor of a rank's file: `entry` (one of the rank's
// Metadata::tensors) goes to `data`, host memory of at least entry->bytes.
struct TensorDestination {
  const TensorEntry* entry = nullptr;
  void* data = nullptr;
};
// Reads `rank`'s data file once, front to back (8 MiB reads), each tensor of `dests` straight
// into its memory and every other byte (alignment padding, tensors not asked for) into a
// scratch buffer, computing the CRC-32C of each read while it is in cache, and checks the
// file's size and CRC-32C against the metadata (errors as OpenCheckpoint's and VerifyFiles').
// A load's one pass: the destinations hold the file's tensors when it returns OK, and bytes of
// a file that failed otherwise (so they must be staging memory). `progress` gets every read.
absl::Status ReadRankFile(const Checkpoint& ckpt, int32_t rank,
                          const std::vector<TensorDestination>& dests,
                          const ProgressFn& progress = nullptr);
// Reads `bytes` at `offset` of `rank`'s file into `dst`.
absl::Status ReadFileRange(const Checkpoint& ckpt, int32_t rank, int64_t offset, int64_t bytes,
                           void* dst);

// ---- Helpers for files (shared with safetensors.cc) ----
namespace internal {
// CRC-32C without the SSE4.2 path (tests compare the two).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);
// A pread loop; errors name `path` and the call.
absl::Status ReadAll(int fd, void* data, size_t n, int64_t offset, const std::string& path);
// FileSystem::Posix()->SyncDir and DirName (common/file_system.h), for older callers.
absl::Status FsyncDir(const std::string& dir);
std::string DirOf(const std::string& path);
// RFC 3339 UTC now.
std::string NowText();
}  // namespace internal

}  // namespace flatshard::checkpoint
