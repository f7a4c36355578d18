#pragma once
// POSIX shared-memory segments (shm_open + mmap), the memory the daemon shares with its
// clients (DESIGN "Data paths"). The daemon creates a segment per buffer and tells clients its
// name; each client opens and maps it once and caches the mapping.
//
//   creator (daemon):  ShmSegment::Create(MakeSegmentName("flatshard"), bytes)
//                      mode 0600, zero-filled, pages reserved up front (so a full /dev/shm is
//                      RESOURCE_EXHAUSTED here, not SIGBUS on first touch); owns the name and
//                      unlinks it when destroyed or on Unlink().
//   client:            ShmSegment::Open(name, bytes, writable): maps an existing segment and
//                      never unlinks it.
//
// A mapping stays valid after the name is unlinked, until the ShmSegment is destroyed. Names
// have the form "/<prefix>.<pid>.<counter>" (MakeSegmentName), so a restarted daemon can find
// and remove what a crashed one left behind (UnlinkSegmentsWithPrefix).
//
// Error codes, each message naming the segment and the errno text: ENOSPC, ENOMEM, EMFILE, EFBIG,
// ENFILE -> RESOURCE_EXHAUSTED; EEXIST -> ALREADY_EXISTS; ENOENT -> NOT_FOUND; EACCES, EPERM ->
// PERMISSION_DENIED; EINVAL, ENAMETOOLONG -> INVALID_ARGUMENT; anything else -> INTERNAL.
//
// Thread safety: a ShmSegment is a value type: const methods may be called concurrently; a
// non-const method (Unlink, Commit, Decommit, assignment) needs exclusive access. Reads and
// writes of the mapped bytes are the caller's business. The free functions are thread-safe.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

class ShmSegment {
 public:
  // Creates the segment `name` (shm_open O_CREAT|O_EXCL|O_RDWR, mode 0600), sizes it to
  // `bytes`, reserves its pages (fallocate; skipped where the filesystem cannot), and maps it
  // shared read-write. The memory is zero. The returned segment owns the name. Zero bytes: the
  // object exists but nothing is mapped and data() is nullptr.
  // Errors: INVALID_ARGUMENT for a bad name (must be "/" plus 1..253 characters without "/")
  // or bytes beyond off_t; ALREADY_EXISTS when the name is taken; RESOURCE_EXHAUSTED when
  // /dev/shm, memory or file descriptors run out. On error nothing is left behind.
  static absl::StatusOr<ShmSegment> Create(absl::string_view name, size_t bytes);

  // Maps the first `bytes` of the existing segment `name`, read-write when `writable`, else
  // read-only. Never unlinks. Zero bytes maps nothing (data() is nullptr) but still requires
  // the segment to exist.
  // Errors: INVALID_ARGUMENT for a bad name; NOT_FOUND when there is no such segment;
  // PERMISSION_DENIED when the mode forbids it; FAILED_PRECONDITION when the segment is smaller
  // than `bytes` (the message gives both sizes).
  static absl::StatusOr<ShmSegment> Open(absl::string_view name, size_t bytes, bool writable);

  // A restarted daemon takes over a segment an earlier daemon created (state directory
  // re-adoption): opens `name` read-write, requires its size to be exactly `bytes`, maps it
  // and owns the name from now on (unlinked when destroyed, like Create's) and keeps its
  // descriptor. Errors: as Open; FAILED_PRECONDITION naming both sizes when the size differs.
  // `populate`: map with MAP_POPULATE (the adopter reads all of it now); without it the pages
  // are faulted in as touched.
  static absl::StatusOr<ShmSegment> Adopt(absl::string_view name, size_t bytes,
                                          bool populate = true);

  ShmSegment() = default;  // empty: no name, nothing mapped
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  // Unmaps; the creator also unlinks the name unless Unlink() already did (a failure is logged,
  // ENOENT silently: someone else removed it).
  ~ShmSegment();

  // Start of the mapping; nullptr when size() is 0 or the segment is empty/moved-from.
  void* data() const { return data_; }
  // Mapped bytes (the `bytes` given to Create/Open).
  size_t size() const { return size_; }
  // The shm name, with its leading "/"; empty for an empty segment.
  const std::string& name() const { return name_; }
  // True for the creator until the name is unlinked.
  bool owns_name() const { return creator_ && !unlinked_; }
  bool writable() const { return writable_; }
  // The creator keeps its descriptor open (Commit/Decommit need it, and a later memfd/
  // SCM_RIGHTS path can hand it over); a client's is closed after mapping: -1. So a daemon
  // holds one descriptor per live segment and should raise RLIMIT_NOFILE at startup.
  int fd() const { return fd_; }

  // Removes the name now; the mapping stays valid, later Open calls fail with NOT_FOUND, and
  // the destructor no longer unlinks. Idempotent: OK when the name is no longer owned.
  // Errors: NOT_FOUND when someone else removed the name first (the segment stops owning it
  // anyway); FAILED_PRECONDITION on a client (Open) segment.
  absl::Status Unlink();
  // Stops owning the name without removing it: the segment outlives this object (a daemon
  // leaving its shards for the next one, --keep_shards). No-op on a client segment.
  void Disown() { unlinked_ = true; }

  // Gives the pages of [offset, offset + length) back to the kernel (fallocate PUNCH_HOLE):
  // the range reads as zero afterwards in every process that maps it, mappings stay valid, and
  // memory use drops. A later write re-allocates pages silently, so call Commit first.
  // REQUIRES: a creator segment. Errors: INVALID_ARGUMENT for a range outside the segment;
  // FAILED_PRECONDITION on a client segment; the errno code when the kernel refuses.
  absl::Status Decommit(size_t offset, size_t length);
  // Reserves pages for [offset, offset + length) again (fallocate), zero where decommitted.
  // Errors: as Decommit, plus RESOURCE_EXHAUSTED when /dev/shm is full.
  absl::Status Commit(size_t offset, size_t length);

  // Bytes the kernel holds for the segment right now (fstat st_blocks * 512): about size()
  // after Create, about 0 after a full Decommit. Errors: FAILED_PRECONDITION without a
  // descriptor (client segments), or the errno code of fstat.
  absl::StatusOr<int64_t> ResidentBytes() const;

 private:
  ShmSegment(std::string name, int fd, void* data, size_t size, bool creator, bool writable)
      : name_(std::move(name)),
        fd_(fd),
        data_(data),
        size_(size),
        creator_(creator),
        writable_(writable) {}
  void Reset();  // unmap, unlink if owned, close; leaves an empty segment
  absl::Status CheckRange(absl::string_view op, size_t offset, size_t length) const;

  std::string name_;
  int fd_ = -1;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool creator_ = false;   // made by Create
  bool unlinked_ = false;  // the creator's name is gone (Unlink)
  bool writable_ = false;
};

// "/<prefix>.<pid>.<counter>", unique within this process (the counter is process-wide and
// atomic) and, while this process lives, across processes.
// REQUIRES: ValidateSegmentPrefix(prefix).ok().
std::string MakeSegmentName(absl::string_view prefix);

// OK when `prefix` can start segment names: 1..200 characters from [A-Za-z0-9_-] (no "/",
// no "." so that "<prefix>." never matches a longer prefix). INVALID_ARGUMENT otherwise.
absl::Status ValidateSegmentPrefix(absl::string_view prefix);

// Startup cleanup after a crash: removes every /dev/shm entry named "<prefix>.<pid>.<n>"
// whose <pid> is this process or a process that no longer exists. Segments of another live
// process with the same prefix are kept (a second daemon, a parallel test), as are names that
// only start with the prefix. Call it before this process creates segments with `prefix`: its
// own are removed too, because in a container a restarted daemon often gets the pid the
// crashed one had. Logs how many it removed.
// Errors: INVALID_ARGUMENT for a bad prefix; the errno code when /dev/shm cannot be listed
// (a missing /dev/shm is OK: nothing to clean). A name that vanishes meanwhile is not an
// error; other unlink failures are, after trying every match (the first one is returned).
absl::Status UnlinkSegmentsWithPrefix(absl::string_view prefix);

}  // namespace flatshard
