#pragma once
// InMemoryFileSystem: a FileSystem (common/file_system.h) held in memory, for unit tests that
// need neither a disk nor processes. Besides the files it keeps what would survive a machine
// crash, and it injects faults:
//   FailNext(op, status, skip)  the (skip+1)-th next call of `op` fails with `status`, once;
//   KillAt(op, skip)            kill -9 of the writer at that call: the call and every later one
//                               fail with ABORTED until Restart(); files stay as they are (a
//                               kill loses nothing the kernel already has);
//   PowerLoss()                 a machine crash: each file reverts to its contents at its last
//                               Sync, each directory to its entries at its last SyncDir.
// Paths are compared as strings: use absolute, normalised paths ("/" always exists). New
// files and directories get their mode as if the umask were 022.
//
// Thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"

namespace flatshard {

class InMemoryFileSystem final : public FileSystem {
 public:
  // The calls faults can be injected into (FileExists cannot fail).
  enum class Op {
    kCreate,  // NewWritableFile
    kAppend,
    kSync,
    kClose,
    kRead,
    kList,
    kRemove,
    kRename,
    kSyncDir,
    kCreateDirs,
  };

  InMemoryFileSystem();
  ~InMemoryFileSystem() override;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const NewFileOptions& options) override;
  absl::StatusOr<std::string> ReadFile(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) override;
  bool FileExists(const std::string& path) override;
  absl::Status RemoveFile(const std::string& path) override;
  absl::Status RenameFile(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::Status CreateDirs(const std::string& dir, uint32_t mode) override;

  // Faults (see the top). REQUIRES: `status` is not OK.
  void FailNext(Op op, absl::Status status, int skip = 0);
  void KillAt(Op op, int skip = 0);
  // A new process after KillAt: calls work again; faults not yet fired are dropped.
  void Restart();
  void PowerLoss();

  // Every file's path, sorted (temp files included).
  std::vector<std::string> Files() const;
  // A file's or directory's permission bits; -1 when there is none.
  int Mode(const std::string& path) const;
  // Calls of `op` so far, failed ones included.
  int Calls(Op op) const;
  // Creates or replaces a file, durably and without faults (test fixtures: a torn record).
  // REQUIRES: its directory exists.
  void SetFile(const std::string& path, const std::string& contents, uint32_t mode = 0600);

 private:
  class File;
  struct Node {
    std::string data;
    std::string synced;  // `data` at the last Sync: what a power loss leaves
    uint32_t mode = 0;
  };
  struct Fault {
    Op op;
    int skip;
    absl::Status status;  // OK for a kill
  };
  // Counts the call and returns the fault it meets, if any.
  absl::Status Check(Op op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsDir(const std::string& path) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Node>> files_ ABSL_GUARDED_BY(mu_);
  // The names each directory had at its last SyncDir (with SetFile's at once).
  std::map<std::string, std::shared_ptr<Node>> durable_ ABSL_GUARDED_BY(mu_);
  // Directory -> mode; directories are durable once made.
  std::map<std::string, uint32_t> dirs_ ABSL_GUARDED_BY(mu_);
  std::vector<Fault> faults_ ABSL_GUARDED_BY(mu_);
  bool killed_ ABSL_GUARDED_BY(mu_) = false;
  std::map<Op, int> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard
