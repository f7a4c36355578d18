#include "common/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/shm_testing.h"

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

using ::flatshard::testing::ListSegments;
using ::flatshard::testing::SegmentExists;

// A leftover as a crashed daemon would leave it: created and never unlinked.
void CreateRaw(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << name << ": " << std::strerror(errno);
  close(fd);
}

// The pid of a process that has exited and been reaped.
pid_t DeadPid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  int status = 0;
  waitpid(pid, &status, 0);
  return pid;
}

class ShmSegmentTest : public ::testing::Test {
 protected:
  // Unique per process and test, so parallel runs never collide.
  ShmSegmentTest()
      : prefix_(absl::StrCat("fs_shmtest_", getpid(), "_",
                             ::testing::UnitTest::GetInstance()->current_test_info()->name())) {}

  void TearDown() override {
    const std::vector<std::string> left = ListSegments(prefix_);
    EXPECT_THAT(left, IsEmpty()) << "segments left behind";
    for (const std::string& name : left) shm_unlink(("/" + name).c_str());
  }

  std::string NewName() { return MakeSegmentName(prefix_); }

  const std::string prefix_;
};

TEST_F(ShmSegmentTest, CreateMapsZeroedReadWriteMemory) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 10000);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(seg->name(), name);
  EXPECT_EQ(seg->size(), 10000u);
  EXPECT_TRUE(seg->owns_name());
  EXPECT_TRUE(seg->writable());
  EXPECT_GE(seg->fd(), 0);
  ASSERT_NE(seg->data(), nullptr);
  const auto* bytes = static_cast<const uint8_t*>(seg->data());
  for (size_t i = 0; i < seg->size(); ++i) ASSERT_EQ(bytes[i], 0) << i;
  std::memset(seg->data(), 0xab, seg->size());
  EXPECT_TRUE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, ForkedProcessSeesTheSameBytes) {
  constexpr size_t kBytes = 3 * 4096 + 17;
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, kBytes);
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto* bytes = static_cast<uint8_t*>(seg->data());
  for (size_t i = 0; i < kBytes; ++i) bytes[i] = static_cast<uint8_t>(i * 7);

  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: a client. Exit codes say what went wrong.
    absl::StatusOr<ShmSegment> client = ShmSegment::Open(name, kBytes, /*writable=*/true);
    if (!client.ok()) _exit(2);
    if (client->owns_name() || client->fd() != -1) _exit(3);
    auto* seen = static_cast<uint8_t*>(client->data());
    for (size_t i = 0; i < kBytes - 1; ++i) {
      if (seen[i] != static_cast<uint8_t>(i * 7)) _exit(4);
    }
    seen[kBytes - 1] = 0x5a;  // the parent must see this
    absl::StatusOr<ShmSegment> ro = ShmSegment::Open(name, kBytes, /*writable=*/false);
    if (!ro.ok() || ro->writable() || static_cast<uint8_t*>(ro->data())[0] != 0) _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(bytes[kBytes - 1], 0x5a);
  // The client's exit did not unlink the name.
  EXPECT_TRUE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, ModeIs0600EvenUnderARestrictiveUmask) {
  const mode_t old_umask = umask(0277);
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(NewName(), 4096);
  umask(old_umask);
  ASSERT_TRUE(seg.ok()) << seg.status();
  struct stat st;
  ASSERT_EQ(fstat(seg->fd(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  ASSERT_EQ(stat(("/dev/shm" + seg->name()).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(ShmSegmentTest, NameCollisionIsAlreadyExistsAndKeepsTheFirst) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> first = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  static_cast<uint8_t*>(first->data())[0] = 42;
  absl::StatusOr<ShmSegment> second = ShmSegment::Create(name, 4096);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(second.status().message(), HasSubstr(name));
  EXPECT_THAT(second.status().message(), HasSubstr("File exists"));
  // The failed Create must not have unlinked or truncated the first one.
  absl::StatusOr<ShmSegment> client = ShmSegment::Open(name, 4096, false);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ(static_cast<const uint8_t*>(client->data())[0], 42);
}

TEST_F(ShmSegmentTest, OpenOfAMissingNameIsNotFound) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Open(name, 4096, true);
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(seg.status().message(), HasSubstr(name));
  EXPECT_THAT(seg.status().message(), HasSubstr("No such file or directory"));
}

TEST_F(ShmSegmentTest, OpenLargerThanTheSegmentIsRefused) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  absl::StatusOr<ShmSegment> big = ShmSegment::Open(name, 4097, false);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(big.status().message(), HasSubstr(name));
  EXPECT_THAT(big.status().message(), HasSubstr("has 4096 bytes, want at least 4097"));
  // A prefix of the segment is fine.
  absl::StatusOr<ShmSegment> small = ShmSegment::Open(name, 100, false);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->size(), 100u);
}

TEST_F(ShmSegmentTest, DestructorUnlinks) {
  const std::string name = NewName();
  {
    absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 4096);
    ASSERT_TRUE(seg.ok()) << seg.status();
    ASSERT_TRUE(SegmentExists(name));
  }
  errno = 0;
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

TEST_F(ShmSegmentTest, UnlinkRemovesTheNameButKeepsTheMapping) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(seg->Unlink().ok());
  EXPECT_FALSE(seg->owns_name());
  EXPECT_FALSE(SegmentExists(name));
  EXPECT_EQ(ShmSegment::Open(name, 0, false).status().code(), absl::StatusCode::kNotFound);
  static_cast<uint8_t*>(seg->data())[4095] = 1;  // still mapped
  EXPECT_TRUE(seg->Unlink().ok());               // idempotent
}

TEST_F(ShmSegmentTest, UnlinkReportsANameRemovedBySomeoneElse) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_EQ(shm_unlink(name.c_str()), 0);
  EXPECT_EQ(seg->Unlink().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(seg->owns_name());
}

TEST_F(ShmSegmentTest, ClientsNeverUnlink) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  {
    absl::StatusOr<ShmSegment> client = ShmSegment::Open(name, 4096, true);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ(client->Unlink().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, ZeroByteSegmentsMapNothing) {
  const std::string name = NewName();
  {
    absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, 0);
    ASSERT_TRUE(seg.ok()) << seg.status();
    EXPECT_EQ(seg->data(), nullptr);
    EXPECT_EQ(seg->size(), 0u);
    EXPECT_TRUE(SegmentExists(name));
    absl::StatusOr<ShmSegment> client = ShmSegment::Open(name, 0, true);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ(client->data(), nullptr);
    EXPECT_EQ(ShmSegment::Open(name, 1, true).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(seg->Decommit(0, 0).ok());
    EXPECT_TRUE(seg->Commit(0, 0).ok());
  }
  EXPECT_FALSE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, BadNamesAreInvalidArgument) {
  for (const std::string& name :
       {std::string(""), std::string("/"), std::string("no_slash"), std::string("/a/b"),
        "/" + std::string(254, 'x'), std::string("/nul\0in", 7)}) {
    EXPECT_EQ(ShmSegment::Create(name, 1).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(ShmSegment::Open(name, 1, false).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
}

TEST_F(ShmSegmentTest, TooLargeIsResourceExhaustedAndLeavesNothing) {
  const std::string name = NewName();
  // 1 PiB: more than /dev/shm holds (fallocate ENOSPC) and than the address space (mmap).
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, size_t{1} << 50);
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted) << seg.status();
  EXPECT_THAT(seg.status().message(), HasSubstr(name));
  EXPECT_FALSE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, MoveTransfersOwnership) {
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> created = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  ShmSegment a = *std::move(created);
  void* data = a.data();
  ShmSegment b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_TRUE(a.name().empty());
  EXPECT_FALSE(a.owns_name());
  EXPECT_EQ(b.data(), data);
  EXPECT_TRUE(b.owns_name());
  ShmSegment c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.name(), name);
  { ShmSegment dropped = std::move(a); }  // destroying an empty segment touches nothing
  EXPECT_TRUE(SegmentExists(name));
  // Assigning over a live segment frees it.
  absl::StatusOr<ShmSegment> other = ShmSegment::Create(NewName(), 10);
  ASSERT_TRUE(other.ok());
  c = *std::move(other);
  EXPECT_FALSE(SegmentExists(name));
}

TEST_F(ShmSegmentTest, DecommitReturnsPagesAndZeroesEveryMapping) {
  constexpr size_t kBytes = 1 << 20;
  const std::string name = NewName();
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(name, kBytes);
  ASSERT_TRUE(seg.ok()) << seg.status();
  absl::StatusOr<ShmSegment> client = ShmSegment::Open(name, kBytes, true);
  ASSERT_TRUE(client.ok()) << client.status();
  std::memset(seg->data(), 0x11, kBytes);
  absl::StatusOr<int64_t> resident = seg->ResidentBytes();
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_GE(*resident, static_cast<int64_t>(kBytes));

  ASSERT_TRUE(seg->Decommit(0, kBytes).ok());
  EXPECT_EQ(*seg->ResidentBytes(), 0);
  const auto* seen = static_cast<const uint8_t*>(client->data());
  for (size_t i = 0; i < kBytes; i += 4096) ASSERT_EQ(seen[i], 0) << i;

  ASSERT_TRUE(seg->Commit(0, kBytes).ok());
  EXPECT_GE(*seg->ResidentBytes(), static_cast<int64_t>(kBytes));
  EXPECT_EQ(seen[kBytes - 1], 0);
  static_cast<uint8_t*>(client->data())[5] = 9;  // the same mapping still works both ways
  EXPECT_EQ(static_cast<const uint8_t*>(seg->data())[5], 9);

  EXPECT_EQ(seg->Decommit(kBytes - 1, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seg->Commit(kBytes + 1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Decommit(0, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->ResidentBytes().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShmSegmentTest, MakeSegmentNameIsUniqueAndWellFormed) {
  std::set<std::string> names;
  for (int i = 0; i < 1000; ++i) {
    const std::string name = MakeSegmentName(prefix_);
    ASSERT_TRUE(absl::StartsWith(name, absl::StrCat("/", prefix_, ".", getpid(), "."))) << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 1000u);
}

TEST_F(ShmSegmentTest, ValidateSegmentPrefix) {
  EXPECT_TRUE(ValidateSegmentPrefix("flatshard").ok());
  EXPECT_TRUE(ValidateSegmentPrefix("fs-test_1").ok());
  for (absl::string_view bad : {"", "a/b", "a.b", "/flatshard", "sp ace", "\xff"}) {
    EXPECT_EQ(ValidateSegmentPrefix(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ValidateSegmentPrefix(std::string(201, 'a')).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmSegmentTest, UnlinkSegmentsWithPrefixRemovesOnlyLeftoversOfDeadOrOwnPids) {
  const std::string p = prefix_;
  const pid_t dead = DeadPid();
  const std::string own = absl::StrCat(p, ".", getpid(), ".1");
  const std::string of_dead = absl::StrCat(p, ".", dead, ".7");
  const std::string of_live = absl::StrCat(p, ".1.3");  // pid 1 always exists
  const std::vector<std::string> not_ours = {
      absl::StrCat(p, ".abc"),
      absl::StrCat(p, ".12"),
      absl::StrCat(p, ".12.x"),
      absl::StrCat(p, ".+12.3"),
      absl::StrCat(p, ".", dead, ".1.2"),
      absl::StrCat(p, "x.", dead, ".1"),
  };
  for (const std::string& n : {own, of_dead, of_live}) CreateRaw("/" + n);
  for (const std::string& n : not_ours) CreateRaw("/" + n);

  ASSERT_TRUE(UnlinkSegmentsWithPrefix(p).ok());
  std::vector<std::string> expected_left = not_ours;
  expected_left.push_back(of_live);
  std::vector<std::string> left = ListSegments(p);
  for (const std::string& n : ListSegments(p + "x")) left.push_back(n);
  EXPECT_THAT(left, UnorderedElementsAre(expected_left[0], expected_left[1], expected_left[2],
                                         expected_left[3], expected_left[4], expected_left[5],
                                         expected_left[6]));
  for (const std::string& n : left) shm_unlink(("/" + n).c_str());

  EXPECT_TRUE(UnlinkSegmentsWithPrefix(p).ok());  // nothing to do is fine
  EXPECT_EQ(UnlinkSegmentsWithPrefix("bad/prefix").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmSegmentTest, UnlinkSegmentsWithPrefixLeavesLiveMappingsUsable) {
  // What a restarted daemon does to segments of its own pid: names go, nothing breaks.
  absl::StatusOr<ShmSegment> seg = ShmSegment::Create(NewName(), 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(UnlinkSegmentsWithPrefix(prefix_).ok());
  EXPECT_THAT(ListSegments(prefix_), ElementsAre());
  static_cast<uint8_t*>(seg->data())[0] = 1;
}

}  // namespace
}  // namespace flatshard
