#include "server/instance_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace flatshard::server {
namespace {

// A path that keeps being replaced while we lock it is a bug elsewhere, not worth waiting on.
constexpr int kReplacedAttempts = 5;

std::string Errno(int e) { return std::strerror(e); }

}  // namespace

int64_t FlockHolderPid(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return -1;
  // "<n>: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> <start> <end>" (hex device).
  const std::string device = absl::StrCat(absl::Hex(major(st.st_dev), absl::kZeroPad2), ":",
                                          absl::Hex(minor(st.st_dev), absl::kZeroPad2), ":",
                                          static_cast<uint64_t>(st.st_ino));
  std::ifstream in("/proc/locks");
  std::string line;
  while (std::getline(in, line)) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.size() < 6 || f[1] == "->" || f[1] != "FLOCK" || f[5] != device) continue;
    int64_t pid = 0;
    if (absl::SimpleAtoi(f[4], &pid) && pid > 0) return pid;
  }
  return -1;
}

absl::StatusOr<std::unique_ptr<InstanceLock>> InstanceLock::Acquire(const std::string& path,
                                                                    Kind kind,
                                                                    absl::string_view what) {
  for (int attempt = 0; attempt < kReplacedAttempts; ++attempt) {
    const int fd = kind == Kind::kDirectory
                       ? ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                       : ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      return absl::InternalError(
          absl::StrCat(what, ": cannot open ", path, " to lock it: ", Errno(errno)));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      const int64_t holder = e == EWOULDBLOCK ? FlockHolderPid(fd) : -1;
      ::close(fd);
      if (e != EWOULDBLOCK) {
        return absl::InternalError(absl::StrCat(what, ": cannot lock ", path, ": ", Errno(e)));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          what, " is in use by another flatshardd (",
          holder > 0 ? absl::StrCat("pid ", holder) : std::string("its pid is not visible here"),
          ", holding the lock on ", path,
          "): stop that daemon first, or give this one its own --socket and --state_dir"));
    }
    if (kind == Kind::kLockFile) {
      // A daemon stopping between our open and our lock removed the file (or another one
      // replaced it): then our lock guards nothing; lock what is there now.
      struct stat held, now;
      if (::fstat(fd, &held) != 0 || ::stat(path.c_str(), &now) != 0 || held.st_ino != now.st_ino ||
          held.st_dev != now.st_dev) {
        ::close(fd);
        continue;
      }
    }
    return std::unique_ptr<InstanceLock>(new InstanceLock(fd, path, kind));
  }
  return absl::InternalError(absl::StrCat(what, ": the lock file ", path, " was replaced ",
                                          kReplacedAttempts, " times while locking it"));
}

InstanceLock::InstanceLock(int fd, std::string path, Kind kind)
    : fd_(fd), path_(std::move(path)), kind_(kind) {}

InstanceLock::~InstanceLock() {
  // Removed while held: a daemon starting now either locks it after us and finds it gone
  // (and retries), or creates a fresh one.
  if (kind_ == Kind::kLockFile && ::unlink(path_.c_str()) != 0 && errno != ENOENT) {
    FS_LOG(WARNING) << "cannot remove the lock file " << path_ << ": " << Errno(errno);
  }
  ::close(fd_);
}

}  // namespace flatshard::server
