#pragma once
// InstanceLock: one flatshardd per Unix socket and per state directory. A second daemon given
// the same --socket or --state_dir refuses to start, naming the pid of the daemon that holds
// it, instead of taking the socket over (the first daemon would keep running, unreachable,
// holding its shards) or adopting the live daemon's shards as its own.
//
// The lock is an exclusive flock(2), taken without waiting: on a directory itself (the state
// directory: no file is added to it), or on a lock file next to what it guards (the socket:
// "<socket>.lock", created 0600). The kernel releases it when the process dies however it
// dies, so a daemon killed with -9 never blocks its restart. A lock file is removed while
// still held, when the lock is released; a daemon that locked a file that was removed or
// replaced in between takes the new one instead (so two daemons never hold two inodes of
// one path).
//
// The pid named in a refusal is read from /proc/locks (flock records its holder there);
// where it cannot be found (another pid namespace), the error says so.
//
// Thread-compatible; a lock lives as long as the object.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server {

class InstanceLock {
 public:
  enum class Kind {
    kDirectory,  // `path` is an existing directory: the lock is on it
    kLockFile,   // `path` is a lock file, created if missing (its directory must exist)
  };

  // Locks `path` for this process. FAILED_PRECONDITION when another process (or another
  // InstanceLock of this one) holds it, naming `what` (e.g. "--socket unix:/run/x.sock") and
  // the holder's pid; INTERNAL for an unexpected system error, naming the path.
  static absl::StatusOr<std::unique_ptr<InstanceLock>> Acquire(const std::string& path, Kind kind,
                                                               absl::string_view what);
  // Removes a lock file, then releases the lock.
  ~InstanceLock();
  InstanceLock(const InstanceLock&) = delete;
  InstanceLock& operator=(const InstanceLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  InstanceLock(int fd, std::string path, Kind kind);

  const int fd_;
  const std::string path_;
  const Kind kind_;
};

// The pid /proc/locks names as the holder of a flock on the file `fd` refers to; -1 when none
// is listed (or /proc/locks cannot be read).
int64_t FlockHolderPid(int fd);

}  // namespace flatshard::server
