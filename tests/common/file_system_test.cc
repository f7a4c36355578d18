// The one atomic write (common/file_system.h) on the real file system, and its steps under
// injected failures, kills and power loss on InMemoryFileSystem.

#include "common/file_system.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/in_memory_file_system.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using Op = InMemoryFileSystem::Op;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::vector<std::string> Names(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

uint32_t ModeOf(const std::filesystem::path& p) {
  struct stat st;
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 0777;
}

class PosixFileSystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("file_system_test.", ::getpid(), ".", counter_++);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    old_umask_ = ::umask(022);
  }
  void TearDown() override {
    ::umask(old_umask_);
    std::filesystem::remove_all(dir_);
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  FileSystem* fs_ = FileSystem::Posix();
  std::filesystem::path dir_;
  mode_t old_umask_ = 0;
  static inline int counter_ = 0;
};

TEST_F(PosixFileSystemTest, WriteFileAtomicallyReplacesAndLeavesOnlyTheFile) {
  ASSERT_TRUE(WriteFileAtomically(fs_, Path("r.json"), "one").ok());
  ASSERT_TRUE(WriteFileAtomically(fs_, Path("r.json"), "two").ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "r.json"), "two");
  EXPECT_EQ(ModeOf(dir_ / "r.json"), 0600u);
  EXPECT_THAT(Names(dir_), ElementsAre("r.json"));
}

TEST_F(PosixFileSystemTest, TheTempFileIsNeverVisibleUnderTheFinalName) {
  ASSERT_TRUE(WriteFileAtomically(fs_, Path("r.json"), "old").ok());
  absl::StatusOr<std::unique_ptr<AtomicFile>> f = AtomicFile::Create(fs_, Path("r.json"), {});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT((*f)->temp_path(), StartsWith(Path(".tmp.r.json.")));
  ASSERT_TRUE((*f)->Append("new, ").ok());
  ASSERT_TRUE((*f)->Append("complete").ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "r.json"), "old");
  EXPECT_EQ(testing::ReadFile((*f)->temp_path()), "new, complete");
  ASSERT_TRUE((*f)->Publish().ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "r.json"), "new, complete");
  EXPECT_THAT(Names(dir_), ElementsAre("r.json"));
}

TEST_F(PosixFileSystemTest, TwoWritersOfOneFileNeverShareATempFile) {
  auto a = AtomicFile::Create(fs_, Path("r.json"), {});
  auto b = AtomicFile::Create(fs_, Path("r.json"), {});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->temp_path(), (*b)->temp_path());
  ASSERT_TRUE((*a)->Append("a").ok());
  ASSERT_TRUE((*b)->Append("b").ok());
  ASSERT_TRUE((*b)->Publish().ok());
  ASSERT_TRUE((*a)->Publish().ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "r.json"), "a");
}

TEST_F(PosixFileSystemTest, AnUnpublishedFileRemovesItsTempAndLeavesTheOldOne) {
  ASSERT_TRUE(WriteFileAtomically(fs_, Path("r.json"), "old").ok());
  {
    auto f = AtomicFile::Create(fs_, Path("r.json"), {});
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Append("half").ok());
  }
  EXPECT_THAT(Names(dir_), ElementsAre("r.json"));
  EXPECT_EQ(testing::ReadFile(dir_ / "r.json"), "old");
}

TEST_F(PosixFileSystemTest, ModeAndTempSuffixAreTheCallers) {
  AtomicWriteOptions options;
  options.mode = 0644;
  options.temp_suffix = ".tmp";
  // What a killed writer left is truncated and reused, not piled up.
  std::ofstream(dir_ / "data.bin.tmp") << "left by a killed writer, longer than the new file";
  auto f = AtomicFile::Create(fs_, Path("data.bin"), options);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->temp_path(), Path("data.bin.tmp"));
  ASSERT_TRUE((*f)->Append("bytes").ok());
  ASSERT_TRUE((*f)->Publish().ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "data.bin"), "bytes");
  EXPECT_EQ(ModeOf(dir_ / "data.bin"), 0644u);
  EXPECT_THAT(Names(dir_), ElementsAre("data.bin"));
}

TEST_F(PosixFileSystemTest, ErrorsNameTheFileAndTheFailedCall) {
  const std::string missing = Path("nope/r.json");
  absl::Status s = WriteFileAtomically(fs_, missing, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()),
              StartsWith(missing + ": open " + Path("nope/.tmp.r.json.")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("No such file or directory"));

  std::ofstream(dir_ / "plain") << "x";
  s = fs_->SyncDir(Path("plain"));
  EXPECT_EQ(s.message(), absl::StrCat("open directory ", Path("plain"), ": Not a directory"));
  s = fs_->SyncDir(Path("gone"));
  EXPECT_EQ(s.message(),
            absl::StrCat("open directory ", Path("gone"), ": No such file or directory"));

  // A rename onto a directory fails after the write: the temp file goes, the error says so.
  std::filesystem::create_directories(dir_ / "sub");
  std::ofstream(dir_ / "sub" / "x") << "x";
  s = WriteFileAtomically(fs_, Path("sub"), "x");
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), StartsWith(Path("sub") + ": rename "));
  EXPECT_THAT(Names(dir_), ElementsAre("plain", "sub"));
}

TEST_F(PosixFileSystemTest, AbsentIsNotFoundForReadListAndRemove) {
  EXPECT_TRUE(absl::IsNotFound(fs_->ReadFile(Path("none")).status()));
  EXPECT_TRUE(absl::IsNotFound(fs_->ListDir(Path("none")).status()));
  EXPECT_TRUE(absl::IsNotFound(fs_->RemoveFile(Path("none"))));
  EXPECT_FALSE(fs_->FileExists(Path("none")));
  ASSERT_TRUE(WriteFileAtomically(fs_, Path("a"), "x").ok());
  EXPECT_TRUE(fs_->FileExists(Path("a")));
  EXPECT_EQ(*fs_->ReadFile(Path("a")), "x");
  EXPECT_THAT(*fs_->ListDir(dir_.string()), ElementsAre("a"));
  EXPECT_TRUE(fs_->RemoveFile(Path("a")).ok());
  EXPECT_TRUE(fs_->ListDir(dir_.string())->empty());
}

TEST_F(PosixFileSystemTest, AnExclusiveCreateNeverTruncatesAnotherWritersFile) {
  std::ofstream(dir_ / "f") << "someone else's";
  absl::StatusOr<std::unique_ptr<WritableFile>> f =
      fs_->NewWritableFile(Path("f"), {.mode = 0600, .exclusive = true});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(), absl::StrCat("open ", Path("f"), ": File exists"));
  EXPECT_EQ(testing::ReadFile(dir_ / "f"), "someone else's");
  f = fs_->NewWritableFile(Path("f"), {.mode = 0600, .exclusive = false});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(testing::ReadFile(dir_ / "f"), "");  // truncated
}

TEST_F(PosixFileSystemTest, CreateDirsGivesTheLastDirectoryExactlyItsMode) {
  const std::string deep = Path("a/b/c");
  ASSERT_TRUE(fs_->CreateDirs(deep, 0700).ok());
  EXPECT_EQ(ModeOf(deep), 0700u);
  EXPECT_EQ(ModeOf(dir_ / "a"), 0755u);  // parents as mkdir -p makes them
  ::chmod(deep.c_str(), 0755);
  ASSERT_TRUE(fs_->CreateDirs(deep, 0700).ok());
  EXPECT_EQ(ModeOf(deep), 0700u);
  std::ofstream(dir_ / "file") << "x";
  absl::Status s = fs_->CreateDirs(Path("file"), 0700);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), Path("file") + ": not a directory");
}

// ---- The steps of an atomic write, on InMemoryFileSystem ----

class AtomicWriteStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs_.CreateDirs("/d", 0700).ok());
    ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "old").ok());
  }
  std::string Read(const std::string& path) {
    absl::StatusOr<std::string> s = fs_.ReadFile(path);
    return s.ok() ? *s : std::string(s.status().ToString());
  }
  InMemoryFileSystem fs_;
};

TEST_F(AtomicWriteStepsTest, AFailureAtAnyStepBeforeTheRenameLeavesTheOldFileAndNoTemp) {
  for (Op op : {Op::kCreate, Op::kAppend, Op::kSync, Op::kClose, Op::kRename}) {
    SCOPED_TRACE(static_cast<int>(op));
    fs_.FailNext(op, absl::InternalError("injected"));
    absl::Status s = WriteFileAtomically(&fs_, "/d/f", "new");
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(s.message()), StartsWith("/d/f: "));
    EXPECT_THAT(std::string(s.message()), HasSubstr("injected"));
    EXPECT_EQ(Read("/d/f"), "old");
    EXPECT_THAT(fs_.Files(), ElementsAre("/d/f"));
  }
  ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "new").ok());
  EXPECT_EQ(Read("/d/f"), "new");
}

TEST_F(AtomicWriteStepsTest, AFailedDirectorySyncComesAfterTheNewFileIsInPlace) {
  fs_.FailNext(Op::kSyncDir, absl::InternalError("EIO"));
  absl::Status s = WriteFileAtomically(&fs_, "/d/f", "new");
  EXPECT_EQ(s.message(), "/d/f: fsync directory /d: EIO");
  EXPECT_EQ(Read("/d/f"), "new");
}

TEST_F(AtomicWriteStepsTest, AKillBeforeTheRenameLeavesTheOldFileAndACompleteTemp) {
  fs_.KillAt(Op::kRename);
  EXPECT_TRUE(absl::IsAborted(WriteFileAtomically(&fs_, "/d/f", "new")));
  fs_.Restart();
  EXPECT_EQ(Read("/d/f"), "old");
  std::vector<std::string> files = fs_.Files();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_THAT(files[0], StartsWith("/d/.tmp.f."));  // the next writer's business (StateDir::Open)
  EXPECT_EQ(Read(files[0]), "new");
}

TEST_F(AtomicWriteStepsTest, WithSyncTheWriteSurvivesAPowerLoss) {
  ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "new").ok());
  fs_.PowerLoss();
  EXPECT_EQ(Read("/d/f"), "new");
  EXPECT_THAT(fs_.Files(), ElementsAre("/d/f"));
}

TEST_F(AtomicWriteStepsTest, WithoutTheDirectorySyncAPowerLossUndoesTheRename) {
  AtomicWriteOptions options;
  options.sync_dir = false;
  ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "new", options).ok());
  fs_.PowerLoss();
  EXPECT_EQ(Read("/d/f"), "old");  // the old file or the new one: never a torn one
  ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "new", options).ok());
  ASSERT_TRUE(fs_.SyncDir("/d").ok());  // what WriteMetadata's directory fsync does
  fs_.PowerLoss();
  EXPECT_EQ(Read("/d/f"), "new");
}

TEST_F(AtomicWriteStepsTest, WithoutSyncNoFsyncIsMade) {
  AtomicWriteOptions options;
  options.sync = false;
  const int syncs = fs_.Calls(Op::kSync), dir_syncs = fs_.Calls(Op::kSyncDir);
  ASSERT_TRUE(WriteFileAtomically(&fs_, "/d/f", "new", options).ok());
  EXPECT_EQ(fs_.Calls(Op::kSync), syncs);
  EXPECT_EQ(fs_.Calls(Op::kSyncDir), dir_syncs);
  EXPECT_EQ(Read("/d/f"), "new");
  fs_.PowerLoss();
  EXPECT_EQ(Read("/d/f"), "old");
}

// ---- InMemoryFileSystem itself ----

TEST(InMemoryFileSystemTest, PowerLossKeepsOnlySyncedBytesUnderSyncedNames) {
  InMemoryFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/d", 0700).ok());
  auto f = fs.NewWritableFile("/d/a", {});
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Append("synced").ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Append(" and not").ok());
  ASSERT_TRUE(fs.SyncDir("/d").ok());
  auto g = fs.NewWritableFile("/d/b", {});  // never in a synced directory
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE((*g)->Sync().ok());
  EXPECT_EQ(*fs.ReadFile("/d/a"), "synced and not");
  fs.PowerLoss();
  EXPECT_EQ(*fs.ReadFile("/d/a"), "synced");
  EXPECT_THAT(fs.Files(), ElementsAre("/d/a"));
}

TEST(InMemoryFileSystemTest, FaultsFireOnTheRightCallOnce) {
  InMemoryFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/d", 0700).ok());
  fs.FailNext(Op::kRead, absl::InternalError("second read"), /*skip=*/1);
  fs.SetFile("/d/a", "x");
  EXPECT_TRUE(fs.ReadFile("/d/a").ok());
  absl::StatusOr<std::string> second = fs.ReadFile("/d/a");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().message(), "read /d/a: second read");
  EXPECT_TRUE(fs.ReadFile("/d/a").ok());
  EXPECT_EQ(fs.Calls(Op::kRead), 3);

  fs.KillAt(Op::kList);
  EXPECT_TRUE(absl::IsAborted(fs.ListDir("/d").status()));
  EXPECT_TRUE(absl::IsAborted(fs.ReadFile("/d/a").status()));  // a killed process does nothing
  fs.Restart();
  EXPECT_THAT(*fs.ListDir("/d"), ElementsAre("a"));
}

TEST(InMemoryFileSystemTest, ModesDirectoriesAndErrorsReadLikePosix) {
  InMemoryFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/a/b", 0700).ok());
  EXPECT_EQ(fs.Mode("/a"), 0755);
  EXPECT_EQ(fs.Mode("/a/b"), 0700);
  EXPECT_THAT(*fs.ListDir("/a"), ElementsAre("b"));
  ASSERT_TRUE(WriteFileAtomically(&fs, "/a/b/f", "x").ok());
  EXPECT_EQ(fs.Mode("/a/b/f"), 0600);
  EXPECT_EQ(fs.CreateDirs("/a/b/f", 0700).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs.NewWritableFile("/a/b/f", {.mode = 0600, .exclusive = true}).status().message(),
            "open /a/b/f: File exists");
  EXPECT_EQ(fs.NewWritableFile("/x/f", {}).status().message(),
            "open /x/f: No such file or directory");
  EXPECT_TRUE(absl::IsNotFound(fs.RemoveFile("/a/b/g")));
}

}  // namespace
}  // namespace flatshard
