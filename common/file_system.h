#pragma once
// FileSystem: the seam between the daemon and the files it keeps across restarts (state
// records, checkpoints, address files), modelled on leveldb::Env. Production code uses
// FileSystem::Posix(); unit tests use InMemoryFileSystem (common/in_memory_file_system.h),
// which injects failures and models a kill -9 or a power loss at any step.
//
// The one crash-consistent write is AtomicFile (and WriteFileAtomically on top of it). It is
// built from the primitives below, so every implementation runs the same steps:
//   create a temp file in the target's directory, write, fsync, close, rename it over the
//   target, fsync the directory.
// A reader, and a process started after a kill at any step, sees the old file or the new
// one, never a part of one: only a complete file ever has the final name. The fsyncs add
// durability across a machine crash: without the file's, the renamed file may come back
// short; without the directory's, the rename itself may be undone.
//
// Thread safety: a FileSystem is thread-safe. A WritableFile or AtomicFile is used by one
// thread at a time.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

// A file open for sequential writing. Errors name the call and the file
// ("write /dir/f: No space left on device") and are INTERNAL.
class WritableFile {
 public:
  // Closes the file if Close was not called (an error there is lost).
  virtual ~WritableFile() = default;

  // Appends `data` at the end of the file.
  virtual absl::Status Append(absl::string_view data) = 0;
  // fsync: the bytes appended so far survive a machine crash.
  virtual absl::Status Sync() = 0;
  // REQUIRES: called at most once; no Append or Sync after it.
  virtual absl::Status Close() = 0;
};

struct NewFileOptions {
  uint32_t mode = 0600;  // permission bits of a new file, before the umask
  // true: fail if the file exists (O_EXCL); false: truncate it.
  bool exclusive = false;
  // true: keep an existing file's bytes and write after them (O_APPEND; an append-only
  // journal). Overrides `exclusive`.
  bool append = false;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // The real file system (POSIX calls). Never deleted.
  static FileSystem* Posix();

  // Errors name the call and the path and are INTERNAL, except where NOT_FOUND is listed.

  // Creates `path` (its directory must exist) for writing.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const NewFileOptions& options) = 0;
  // The whole file. NOT_FOUND when there is none.
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path) = 0;
  // Names of the entries of `dir` (files and directories, without "." and ".."), in no
  // particular order. NOT_FOUND when `dir` does not exist.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) = 0;
  virtual bool FileExists(const std::string& path) = 0;
  // NOT_FOUND when there is no such file.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
  // Renames `from` to `to`, atomically replacing any file `to`.
  virtual absl::Status RenameFile(const std::string& from, const std::string& to) = 0;
  // fsync of the directory: the creates, renames and removes in it survive a machine crash.
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  // mkdir -p (new directories 0777 before the umask); then `dir` itself gets exactly `mode`,
  // also when it existed with another. FAILED_PRECONDITION when it exists and is not a
  // directory.
  virtual absl::Status CreateDirs(const std::string& dir, uint32_t mode) = 0;
};

// The temp file of an atomic write starts with this in its name, unless the writer picked a
// suffix instead (AtomicWriteOptions::temp_suffix).
inline constexpr char kTempFilePrefix[] = ".tmp.";

struct AtomicWriteOptions {
  // fsync the file before the rename and its directory after it. false: no fsync at all; the
  // write is still atomic for every process, it just may not survive a machine crash.
  bool sync = true;
  // With `sync`: fsync the directory after the rename. A writer that publishes several files
  // and then fsyncs the directory once (checkpoint data files, then metadata.json) sets false.
  bool sync_dir = true;
  uint32_t mode = 0600;  // of the new file, before the umask
  // Empty: the temp file is ".tmp.<name>.<pid>.<n>" in the target's directory, fresh for
  // each write and created exclusively, so concurrent writers never share one; readers of the
  // directory skip the prefix (StateDir removes such leftovers at open). Otherwise the temp
  // file is "<path><temp_suffix>", truncated if it exists: one per target, so what a killed
  // writer left (gigabytes for a checkpoint data file) is reused rather than piled up.
  std::string temp_suffix;
};

// A file written under a temp name and published under its final name in one step (the
// sequence at the top). For streamed writes (checkpoint data files, safetensors); a small
// whole file goes through WriteFileAtomically. Errors keep the failed call's code, and their
// message starts with the final path: "/dir/f: rename /dir/.tmp.f.7.0 to /dir/f: ...".
class AtomicFile {
 public:
  // Creates the temp file for `path`. `fs` must outlive the AtomicFile.
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(FileSystem* fs, std::string path,
                                                            AtomicWriteOptions options);
  // Unpublished (never published, or Publish failed): closes and removes the temp file.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }

  // REQUIRES: Publish not called yet.
  absl::Status Append(absl::string_view data);
  // fsync (with `sync`), close, rename over the final path, fsync of the directory (with
  // `sync` and `sync_dir`). Before the rename, an error leaves the old file unchanged (the
  // destructor removes the temp file); an error of the directory's fsync comes after the new
  // file is in place. REQUIRES: called at most once.
  absl::Status Publish();

 private:
  AtomicFile(FileSystem* fs, std::string path, std::string temp, AtomicWriteOptions options,
             std::unique_ptr<WritableFile> file);
  absl::Status Fail(const absl::Status& s) const;

  FileSystem* const fs_;
  const std::string path_;
  const std::string temp_;
  const AtomicWriteOptions options_;
  std::unique_ptr<WritableFile> file_;  // null once closed
  bool renamed_ = false;
};

// Writes `contents` to `path` through an AtomicFile.
absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path,
                                 absl::string_view contents,
                                 const AtomicWriteOptions& options = {});

// "/a/b" -> "/a", "b" -> ".", "/b" -> "/".
std::string DirName(const std::string& path);

}  // namespace flatshard
