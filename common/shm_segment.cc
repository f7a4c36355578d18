#include "common/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

// glibc's shm_open refuses names whose part after "/" (plus its NUL) reaches NAME_MAX.
constexpr size_t kMaxNameChars = 253;
constexpr size_t kMaxPrefixChars = 200;  // leaves room for ".<pid>.<counter>"
constexpr char kShmDir[] = "/dev/shm";

// strerror_r is the GNU flavour (returns char*) under _GNU_SOURCE, which g++ always defines,
// and the XSI one (returns int) elsewhere; these overloads accept either.
[[maybe_unused]] const char* StrErrorResult(const char* result, const char*) { return result; }
[[maybe_unused]] const char* StrErrorResult(int result, const char* buf) {
  return result == 0 ? buf : "unknown error";
}
std::string StrError(int err) {
  char buf[256] = {};
  return StrErrorResult(strerror_r(err, buf, sizeof(buf)), buf);
}

absl::StatusCode ErrnoToCode(int err) {
  switch (err) {
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return absl::StatusCode::kResourceExhausted;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case ENOENT:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EINVAL:
    case ENAMETOOLONG:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status ErrnoStatus(int err, absl::string_view name, absl::string_view op) {
  return absl::Status(ErrnoToCode(err), absl::StrCat("shm segment ", name, ": ", op, ": ",
                                                     StrError(err), " (errno ", err, ")"));
}

absl::Status ValidateName(absl::string_view name) {
  if (name.size() < 2 || name[0] != '/' || name.size() - 1 > kMaxNameChars ||
      name.find('/', 1) != absl::string_view::npos || name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("bad shm segment name \"", absl::CEscape(name),
                                                   "\": want \"/\" and 1..", kMaxNameChars,
                                                   " characters without \"/\""));
  }
  return absl::OkStatus();
}

absl::Status ValidateBytes(absl::string_view name, size_t bytes) {
  if (bytes > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm segment ", name, ": ", bytes, " bytes is too large"));
  }
  return absl::OkStatus();
}

// fallocate on tmpfs returns EINTR when a signal arrives during a large allocation.
int FallocateNoIntr(int fd, int mode, size_t offset, size_t length) {
  int rc;
  do {
    rc = ::fallocate(fd, mode, static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (rc != 0 && errno == EINTR);
  return rc;
}

bool FallocateUnsupported(int err) { return err == EOPNOTSUPP || err == ENOSYS; }

bool AllDigits(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(c)) return false;
  }
  return true;
}

// True when `pid` names a running process (EPERM: it exists, owned by someone else).
bool ProcessAlive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

absl::StatusOr<ShmSegment> ShmSegment::Create(absl::string_view name, size_t bytes) {
  FS_RETURN_IF_ERROR(ValidateName(name));
  FS_RETURN_IF_ERROR(ValidateBytes(name, bytes));
  std::string n(name);
  const int fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, n, "shm_open(O_CREAT|O_EXCL)");
  // From here on a failure must not leave the name behind.
  auto fail = [&](absl::string_view op) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(n.c_str());
    return ErrnoStatus(err, n, op);
  };
  // The umask can only clear bits, but one of 0277 would lock clients out: set 0600 exactly.
  if (::fchmod(fd, 0600) != 0) return fail("fchmod");
  int rc;
  do {
    rc = ::ftruncate(fd, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return fail("ftruncate");
  void* data = nullptr;
  if (bytes > 0) {
    // Reserving now turns a full /dev/shm into ENOSPC here instead of SIGBUS in whichever
    // process first touches the page.
    if (FallocateNoIntr(fd, 0, 0, bytes) != 0 && !FallocateUnsupported(errno)) {
      return fail("fallocate");
    }
    data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) return fail("mmap");
  }
  return ShmSegment(std::move(n), fd, data, bytes, /*creator=*/true, /*writable=*/true);
}

absl::StatusOr<ShmSegment> ShmSegment::Open(absl::string_view name, size_t bytes, bool writable) {
  FS_RETURN_IF_ERROR(ValidateName(name));
  FS_RETURN_IF_ERROR(ValidateBytes(name, bytes));
  std::string n(name);
  const int fd = ::shm_open(n.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, n, writable ? "shm_open(O_RDWR)" : "shm_open(O_RDONLY)");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, n, "fstat");
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment ", n, " has ", st.st_size, " bytes, want at least ", bytes));
  }
  void* data = nullptr;
  if (bytes > 0) {
    data = ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, n, "mmap");
    }
  }
  // The mapping keeps the object alive; a client needs no descriptor per segment.
  ::close(fd);
  return ShmSegment(std::move(n), /*fd=*/-1, data, bytes, /*creator=*/false, writable);
}

absl::StatusOr<ShmSegment> ShmSegment::Adopt(absl::string_view name, size_t bytes, bool populate) {
  FS_RETURN_IF_ERROR(ValidateName(name));
  FS_RETURN_IF_ERROR(ValidateBytes(name, bytes));
  std::string n(name);
  const int fd = ::shm_open(n.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, n, "shm_open(O_RDWR)");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, n, "fstat");
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment ", n, " has ", st.st_size, " bytes, the record says ", bytes));
  }
  void* data = nullptr;
  if (bytes > 0) {
    // MAP_POPULATE: the adopter reads all of it at once (a restore), faster than faulting
    // the pages in one by one.
    data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                  MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, n, "mmap");
    }
  }
  return ShmSegment(std::move(n), fd, data, bytes, /*creator=*/true, /*writable=*/true);
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      creator_(std::exchange(other.creator_, false)),
      unlinked_(std::exchange(other.unlinked_, false)),
      writable_(std::exchange(other.writable_, false)) {
  other.name_.clear();
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    other.name_.clear();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    creator_ = std::exchange(other.creator_, false);
    unlinked_ = std::exchange(other.unlinked_, false);
    writable_ = std::exchange(other.writable_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  if (data_ != nullptr && ::munmap(data_, size_) != 0) {
    FS_LOG(WARNING) << ErrnoStatus(errno, name_, "munmap").message();
  }
  if (owns_name() && ::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    FS_LOG(WARNING) << ErrnoStatus(errno, name_, "shm_unlink").message();
  }
  if (fd_ >= 0) ::close(fd_);
  name_.clear();
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
  creator_ = false;
  unlinked_ = false;
  writable_ = false;
}

absl::Status ShmSegment::Unlink() {
  if (!creator_) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment ", name_, ": only its creator may unlink it"));
  }
  if (unlinked_) return absl::OkStatus();
  unlinked_ = true;
  if (::shm_unlink(name_.c_str()) != 0) return ErrnoStatus(errno, name_, "shm_unlink");
  return absl::OkStatus();
}

absl::Status ShmSegment::CheckRange(absl::string_view op, size_t offset, size_t length) const {
  if (!creator_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment ", name_, ": ", op, " needs the creator's segment"));
  }
  if (offset > size_ || length > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("shm segment ", name_, ": ", op, " of [", offset,
                                                   ", +", length, ") outside its ", size_,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Decommit(size_t offset, size_t length) {
  FS_RETURN_IF_ERROR(CheckRange("decommit", offset, length));
  if (length == 0) return absl::OkStatus();
  if (FallocateNoIntr(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0) {
    if (!FallocateUnsupported(errno)) return ErrnoStatus(errno, name_, "fallocate(PUNCH_HOLE)");
    // Keep the promise that the range reads as zero, without returning the memory.
    std::memset(static_cast<char*>(data_) + offset, 0, length);
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Commit(size_t offset, size_t length) {
  FS_RETURN_IF_ERROR(CheckRange("commit", offset, length));
  if (length == 0) return absl::OkStatus();
  if (FallocateNoIntr(fd_, FALLOC_FL_KEEP_SIZE, offset, length) != 0 &&
      !FallocateUnsupported(errno)) {
    return ErrnoStatus(errno, name_, "fallocate");
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ShmSegment::ResidentBytes() const {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment ", name_, ": no descriptor (not the creator's segment)"));
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, name_, "fstat");
  return static_cast<int64_t>(st.st_blocks) * 512;
}

std::string MakeSegmentName(absl::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat("/", prefix, ".", ::getpid(), ".",
                      counter.fetch_add(1, std::memory_order_relaxed));
}

absl::Status ValidateSegmentPrefix(absl::string_view prefix) {
  bool ok = !prefix.empty() && prefix.size() <= kMaxPrefixChars;
  for (char c : prefix) ok = ok && (absl::ascii_isalnum(c) || c == '_' || c == '-');
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shm segment prefix \"", absl::CEscape(prefix), "\": want 1..",
                     kMaxPrefixChars, " characters from [A-Za-z0-9_-]"));
  }
  return absl::OkStatus();
}

absl::Status UnlinkSegmentsWithPrefix(absl::string_view prefix) {
  FS_RETURN_IF_ERROR(ValidateSegmentPrefix(prefix));
  DIR* dir = ::opendir(kShmDir);
  if (dir == nullptr) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, kShmDir, "opendir");
  }
  const std::string head = absl::StrCat(prefix, ".");
  const pid_t self = ::getpid();
  std::vector<std::string> doomed;
  int kept = 0;
  int readdir_errno = 0;
  for (;;) {
    errno = 0;  // readdir reports errors only through errno; kill() below sets it too
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      readdir_errno = errno;
      break;
    }
    absl::string_view entry_name(entry->d_name);
    if (!absl::ConsumePrefix(&entry_name, head)) continue;
    // Only "<pid>.<counter>" is ours; anything else merely shares the prefix.
    std::vector<absl::string_view> parts = absl::StrSplit(entry_name, '.');
    int64_t pid = 0;
    if (parts.size() != 2 || !AllDigits(parts[0]) || !AllDigits(parts[1]) ||
        !absl::SimpleAtoi(parts[0], &pid) || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) {
      continue;
    }
    if (pid != self && ProcessAlive(static_cast<pid_t>(pid))) {
      ++kept;
      continue;
    }
    doomed.push_back(absl::StrCat("/", entry->d_name));
  }
  ::closedir(dir);
  if (readdir_errno != 0) return ErrnoStatus(readdir_errno, kShmDir, "readdir");

  absl::Status first_error;
  int removed = 0;
  for (const std::string& name : doomed) {
    if (::shm_unlink(name.c_str()) == 0) {
      ++removed;
    } else if (errno != ENOENT && first_error.ok()) {
      first_error = ErrnoStatus(errno, name, "shm_unlink");
    }
  }
  if (removed > 0 || kept > 0) {
    FS_LOG(INFO) << "removed " << removed << " leftover shm segments with prefix=" << prefix
                 << ", kept " << kept << " of live processes";
  }
  return first_error;
}

}  // namespace flatshard
