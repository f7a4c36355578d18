// `--help` of the built flatshardd and flatshardctl (and of every flatshardctl command): exit
// status 0, the flags listed, and nothing that names the build host's source tree.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cli/ctl_runner.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::flatshard::testing::CtlResult;
using ::flatshard::testing::RunCtl;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

// Text that would give away the build host's layout: the source directory, or a source file's
// name (Abseil heads its listing with "Flags from <path of main.cc>").
void ExpectNoSourcePaths(const std::string& text) {
  EXPECT_THAT(text, AllOf(Not(HasSubstr(FS_SOURCE_DIR)), Not(HasSubstr(FS_BINARY_DIR)),
                          Not(HasSubstr(".cc")), Not(HasSubstr("Flags from"))));
}

struct DaemonRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

DaemonRun RunDaemon(const std::string& flags) {
  // Files of this process's own: ctest runs each test of this file as a process of its own, in
  // parallel, and TempDir() is the same /tmp for all of them.
  const std::filesystem::path dir = ::testing::TempDir();
  const std::string tag = absl::StrCat("flatshardd_help_", getpid());
  const std::string out = (dir / (tag + "_out")).string();
  const std::string err = (dir / (tag + "_err")).string();
  // A socket that no test uses, in case a flag is not taken as a help request and it starts.
  const std::string cmd =
      absl::StrCat("timeout 20 ", FS_BINARY_DIR,
                   "/server/flatshardd --ephemeral --socket=", (dir / (tag + ".sock")).string(),
                   " ", flags, " >", out, " 2>", err, " </dev/null");
  const int status = std::system(cmd.c_str());
  DaemonRun run{WIFEXITED(status) ? WEXITSTATUS(status) : 128, testing::ReadFile(out),
                testing::ReadFile(err)};
  std::error_code ignored;
  std::filesystem::remove(out, ignored);
  std::filesystem::remove(err, ignored);
  return run;
}

TEST(FlatshardHelpTest, DaemonHelpExitsZeroListingItsFlagsOnly) {
  for (const char* help : {"--help", "-help", "-h"}) {
    SCOPED_TRACE(help);
    const DaemonRun r = RunDaemon(help);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, IsEmpty());
    EXPECT_THAT(r.out, StartsWith("flatshardd: the flatshard per-node daemon."));
    for (const char* flag : {"--socket (", "--state_dir (", "--gpus (", "--log_level ("}) {
      EXPECT_THAT(r.out, HasSubstr(flag));
    }
    EXPECT_THAT(r.out, HasSubstr("\"/run/flatshard/flatshardd.sock\";"));
    // Abseil's own flags only with --helpfull.
    EXPECT_THAT(r.out, Not(HasSubstr("--flagfile")));
    ExpectNoSourcePaths(r.out);
  }
}

TEST(FlatshardHelpTest, DaemonHelpfullExitsZeroListingEveryFlag) {
  const DaemonRun r = RunDaemon("--log_level=error --helpfull");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("--socket ("), HasSubstr("--flagfile (")));
  ExpectNoSourcePaths(r.out);
}

TEST(FlatshardHelpTest, CtlHelpExitsZeroForEveryCommand) {
  const CtlResult top = RunCtl({"--help"});
  EXPECT_EQ(top.exit_code, 0);
  ExpectNoSourcePaths(top.out);
  const std::vector<std::vector<std::string>> commands = {
      {"plan"},
      {"status"},
      {"groups"},
      {"units"},
      {"pending"},
      {"drain"},
      {"undrain"},
      {"log-level"},
      {"delete-group"},
      {"checkpoint"},
      {"checkpoint", "save"},
      {"checkpoint", "load"},
      {"checkpoint", "import"},
      {"checkpoint", "inspect"},
      {"checkpoint", "export"},
      {"weights"},
      {"weights", "list"},
      {"weights", "inspect"},
      {"weights", "drop"},
  };
  for (std::vector<std::string> command : commands) {
    SCOPED_TRACE(absl::StrJoin(command, " "));
    command.push_back("--help");
    const CtlResult r = RunCtl(command);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, IsEmpty());
    EXPECT_THAT(r.out, StartsWith("Usage: flatshardctl " + command[0]));
    ExpectNoSourcePaths(r.out);
  }
}

// Every command `flatshardctl --help` lists has its entry (".B command ...") in the man page.
TEST(FlatshardHelpTest, ManPageCoversEveryCtlCommand) {
  const CtlResult top = RunCtl({"--help"});
  ASSERT_EQ(top.exit_code, 0);
  const std::string man =
      testing::ReadFile(std::string(FS_SOURCE_DIR) + "/packaging/man/flatshardctl.1");
  ASSERT_FALSE(man.empty());
  std::vector<std::string> commands;
  for (const std::string& line : testing::Lines(top.out)) {
    // "  status     version, ...": a command line of the list.
    if (line.size() < 3 || line.substr(0, 2) != "  " || !absl::ascii_islower(line[2])) continue;
    commands.push_back(line.substr(2, line.find(' ', 2) - 2));
  }
  EXPECT_THAT(commands, ::testing::IsSupersetOf(
                            {"plan", "status", "groups", "undrain", "delete-group", "checkpoint"}));
  for (const std::string& command : commands) {
    const std::string entry = absl::StrCat("\n.B ", absl::StrReplaceAll(command, {{"-", "\\-"}}));
    EXPECT_TRUE(absl::StrContains(man, entry + " ") || absl::StrContains(man, entry + "\n"))
        << "packaging/man/flatshardctl.1 has no entry for " << command;
  }
}

}  // namespace
}  // namespace flatshard
