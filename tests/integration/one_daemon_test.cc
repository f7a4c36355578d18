// One flatshardd per Unix socket and per state directory (README "Restarts"): a second daemon
// given a live daemon's --socket or --state_dir refuses to start, naming the live daemon's
// pid, and the live daemon keeps serving; a daemon killed with -9 never blocks its restart.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct Outcome {
  int exit_code = 0;
  std::string stderr_text;
};

class OneDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("fsonedaemon", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    state_dir_ = (dir_ / "state").string();
    testing::DaemonOptions o;
    o.tag_prefix = "fsone";
    o.extra_flags = {"--state_dir=" + state_dir_};
    first_ = std::make_unique<testing::DaemonProcess>(o);
    ASSERT_TRUE(first_->running());
  }
  void TearDown() override {
    first_.reset();
    fs::remove_all(dir_);
  }

  // A second flatshardd with `flags`; it must exit by itself (a refusal).
  Outcome RunSecond(const std::string& flags) {
    const std::string err = (dir_ / "second.stderr").string();
    const std::string cmd = absl::StrCat(
        "timeout 20 ", FS_BINARY_DIR, "/server/flatshardd --segment_prefix=fsone2", ::getpid(), " ",
        flags, absl::StrContains(flags, "--state_dir") ? "" : " --ephemeral", " 2>", err);
    const int status = std::system(cmd.c_str());
    return Outcome{WIFEXITED(status) ? WEXITSTATUS(status) : 128, testing::ReadFile(err)};
  }

  // The first daemon still serves on its socket: a trainer joins a group of one and leaves.
  void ExpectFirstServes() {
    client::ClientOptions options;
    options.address = first_->address();
    options.call_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->Join("g", 1, 0, "").ok());
    EXPECT_TRUE((*c)->Leave().ok());
  }

  fs::path dir_;
  std::string state_dir_;
  std::unique_ptr<testing::DaemonProcess> first_;
};

TEST_F(OneDaemonTest, ASecondDaemonOnTheSameSocketIsRefusedNamingThePid) {
  const Outcome out = RunSecond(absl::StrCat("--socket=", first_->socket()));
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text,
              HasSubstr(absl::StrCat("--socket unix:", first_->socket(),
                                     " is in use by another flatshardd (pid ", first_->pid())));
  EXPECT_TRUE(fs::exists(first_->socket())) << "the live daemon's socket is left alone";
  ExpectFirstServes();
}

TEST_F(OneDaemonTest, ASecondDaemonOnTheSameStateDirIsRefusedNamingThePid) {
  const Outcome out = RunSecond(
      absl::StrCat("--socket=", (dir_ / "other.sock").string(), " --state_dir=", state_dir_));
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text,
              HasSubstr(absl::StrCat("--state_dir ", state_dir_,
                                     " is in use by another flatshardd (pid ", first_->pid())));
  EXPECT_FALSE(fs::exists(dir_ / "other.sock"));
  EXPECT_FALSE(fs::exists(dir_ / "other.sock.lock")) << "a refused daemon leaves no lock file";
  ExpectFirstServes();
}

TEST_F(OneDaemonTest, AKilledDaemonNeverBlocksItsRestartAndAStoppedOneLeavesNoLockFile) {
  first_->Kill();  // SIGKILL: the lock file stays, its lock goes with the process
  EXPECT_TRUE(fs::exists(first_->socket() + ".lock"));
  ASSERT_TRUE(first_->Restart());
  ExpectFirstServes();
  EXPECT_EQ(first_->Terminate(), 0);
  EXPECT_FALSE(fs::exists(first_->socket() + ".lock"));
  EXPECT_FALSE(fs::exists(first_->socket()));
}

}  // namespace
}  // namespace flatshard
