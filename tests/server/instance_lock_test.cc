// InstanceLock: a second lock of a held socket lock file or state directory is refused naming
// the holder's pid (flock locks are per open file, so one process can play both daemons); the
// lock file goes when released; a lock file replaced under a locker is not trusted.

#include "server/instance_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class InstanceLockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / absl::StrCat("instance_lock_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(InstanceLockTest, ASecondLockOfASocketIsRefusedNamingTheHolder) {
  const std::string path = (dir_ / "d.sock.lock").string();
  auto first = InstanceLock::Acquire(path, InstanceLock::Kind::kLockFile, "--socket unix:d.sock");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(fs::exists(path));
  auto second = InstanceLock::Acquire(path, InstanceLock::Kind::kLockFile, "--socket unix:d.sock");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrCat("--socket unix:d.sock is in use by another flatshardd (pid ",
                                     ::getpid(), ", holding the lock on ", path)));
  first->reset();
  EXPECT_FALSE(fs::exists(path)) << "a released lock file is removed";
  auto third = InstanceLock::Acquire(path, InstanceLock::Kind::kLockFile, "--socket unix:d.sock");
  EXPECT_TRUE(third.ok()) << third.status();
}

TEST_F(InstanceLockTest, AStateDirectoryIsLockedWithoutAddingAFile) {
  auto first = InstanceLock::Acquire(dir_.string(), InstanceLock::Kind::kDirectory, "--state_dir");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(fs::is_empty(dir_));
  auto second = InstanceLock::Acquire(dir_.string(), InstanceLock::Kind::kDirectory, "--state_dir");
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(
      second.status().message(),
      HasSubstr(absl::StrCat("--state_dir is in use by another flatshardd (pid ", ::getpid())));
  first->reset();
  EXPECT_TRUE(fs::exists(dir_)) << "a directory is never removed";
  EXPECT_TRUE(
      InstanceLock::Acquire(dir_.string(), InstanceLock::Kind::kDirectory, "--state_dir").ok());
}

TEST_F(InstanceLockTest, ALockHeldByADeadProcessIsFree) {
  // The kernel releases a flock when its holder dies, however it dies.
  const std::string path = (dir_ / "d.sock.lock").string();
  const pid_t child = fork();
  if (child == 0) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    _exit(fd >= 0 && ::flock(fd, LOCK_EX) == 0 ? 0 : 1);  // dies holding it
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(InstanceLock::Acquire(path, InstanceLock::Kind::kLockFile, "--socket").ok());
}

TEST_F(InstanceLockTest, ALockFileRemovedByItsHolderLeavesThePathFree) {
  // The holder removes its file while it holds it (a daemon stopping); a locker that opened
  // the old file locks a fresh one instead, so one path never has two holders.
  const std::string path = (dir_ / "d.sock.lock").string();
  const int stale = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(stale, 0);
  ASSERT_EQ(::flock(stale, LOCK_EX), 0);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  auto lock = InstanceLock::Acquire(path, InstanceLock::Kind::kLockFile, "--socket");
  ASSERT_TRUE(lock.ok()) << lock.status();  // a fresh file: the old holder guards nothing
  EXPECT_TRUE(fs::exists(path));
  ::close(stale);
}

TEST_F(InstanceLockTest, AMissingDirectoryIsAnErrorNamingIt) {
  const std::string path = (dir_ / "none").string();
  auto lock = InstanceLock::Acquire(path, InstanceLock::Kind::kDirectory, "--state_dir none");
  ASSERT_FALSE(lock.ok());
  EXPECT_THAT(lock.status().message(), HasSubstr(absl::StrCat("cannot open ", path)));
}

}  // namespace
}  // namespace flatshard::server
