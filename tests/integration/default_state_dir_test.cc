// Persistence on by default (README "Restarts"): a flatshardd given neither --state_dir nor
// --ephemeral keeps its records in its default state directory (here $STATE_DIRECTORY, the
// first choice for root and other users alike; the rest is default_state_dir_test's),
// created 0700, logged and shown by `flatshardctl status`; a second such daemon is refused
// as for any shared state directory. --ephemeral keeps nothing, with a warning, and is
// refused together with --state_dir.

#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// The output (stdout and stderr) and exit code of a shell command.
std::pair<int, std::string> Shell(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, ""};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, out};
}

std::string Ctl(const std::string& args) {
  return absl::StrCat(FS_BINARY_DIR, "/client/flatshardctl ", args);
}

class DefaultStateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("fsdefstate", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // The daemons inherit this process's environment: their default is under dir_ (as
    // systemd's StateDirectory= would set it, with a directory of its own below).
    ::setenv("STATE_DIRECTORY", (dir_ / "sd" / "state").c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("STATE_DIRECTORY");
    fs::remove_all(dir_);
  }
  fs::path dir_;
};

TEST_F(DefaultStateDirTest, WithoutFlagsRecordsGoToTheDefaultDirectoryShownByStatus) {
  testing::DaemonOptions o;
  o.tag_prefix = "fsdefstate";
  o.default_state_dir = true;
  testing::DaemonProcess d(o);
  ASSERT_TRUE(d.running());
  const std::string state = (dir_ / "sd" / "state").string();
  struct stat st;
  ASSERT_EQ(::stat(state.c_str(), &st), 0) << state;
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_THAT(d.Log(), HasSubstr(absl::StrCat("state dir ", state, " ($STATE_DIRECTORY)")));
  auto [code, out] = Shell(Ctl(absl::StrCat("status --socket ", d.socket())));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(state));
  auto [jcode, json] = Shell(Ctl(absl::StrCat("status --json --socket ", d.socket())));
  EXPECT_EQ(jcode, 0) << json;
  EXPECT_THAT(json, HasSubstr(absl::StrCat("\"state_dir\": \"", state, "\"")));
  // A second daemon with the same default is refused: one daemon per state directory.
  auto [second, err] = Shell(absl::StrCat(
      "timeout 20 ", FS_BINARY_DIR, "/server/flatshardd --socket=", (dir_ / "2.sock").string(),
      " --segment_prefix=fsdefstate2x", ::getpid()));
  EXPECT_NE(second, 0);
  EXPECT_THAT(err, HasSubstr(absl::StrCat("--state_dir ", state,
                                          " is in use by another flatshardd (pid ", d.pid())));
}

TEST_F(DefaultStateDirTest, EphemeralKeepsNothingWithAWarningAndContradictsAStateDir) {
  testing::DaemonOptions o;
  o.tag_prefix = "fsdefeph";
  testing::DaemonProcess d(o);  // DaemonProcess passes --ephemeral
  ASSERT_TRUE(d.running());
  EXPECT_THAT(d.Log(), HasSubstr("ephemeral (--ephemeral): no records are kept"));
  EXPECT_FALSE(fs::exists(dir_ / "sd"));
  auto [code, out] = Shell(Ctl(absl::StrCat("status --socket ", d.socket())));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("- (ephemeral: a restart keeps nothing)"));
  auto [jcode, json] = Shell(Ctl(absl::StrCat("status --json --socket ", d.socket())));
  EXPECT_THAT(json, HasSubstr("\"state_dir\": null"));

  auto [both, err] = Shell(absl::StrCat("timeout 20 ", FS_BINARY_DIR,
                                        "/server/flatshardd --socket=", (dir_ / "b.sock").string(),
                                        " --ephemeral --state_dir=", (dir_ / "s").string()));
  EXPECT_EQ(both, 1);
  EXPECT_THAT(err, HasSubstr(absl::StrCat("--ephemeral and --state_dir ", (dir_ / "s").string())));
  EXPECT_FALSE(fs::exists(dir_ / "s"));
  EXPECT_FALSE(fs::exists(dir_ / "b.sock"));
}

}  // namespace
}  // namespace flatshard
