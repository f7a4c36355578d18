// The state directory's journal (server/durable/journal.h) on InMemoryFileSystem: a module's
// write appends one frame and fsyncs once, whatever the number of modules; a kill at any byte
// of an append leaves every earlier write intact; stale and out-of-order writes; compaction;
// power loss. No disk, no processes.

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/in_memory_file_system.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"

namespace flatshard::server::state {
namespace {

using Op = InMemoryFileSystem::Op;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr char kDir[] = "/state";

ModuleRecord Module(const std::string& name, uint64_t generation) {
  ModuleRecord m;
  m.name = name;
  m.plan_json = R"({"format":"flatshard.plan/1"})";
  m.manifest_json = R"({"format":"flatshard.manifest/1"})";
  m.initialized = true;
  for (int32_t rank : {0, 1}) {
    m.ranks.push_back(RankRecord{
        rank, generation, {UnitRecord{0, {{kRoleShard, absl::StrCat("/fs.1.", name, rank), 64}}}}});
  }
  return m;
}

// Group "g" with modules m000..m<n-1> at generation 1.
GroupRecord Group(int modules, uint64_t sequence) {
  GroupRecord r;
  r.id = "g";
  r.world_size = 2;
  r.token = "tok";
  r.owner_uid = 1000;
  r.local_ranks = {0, 1};
  r.epoch = 1;
  r.sequence = sequence;
  for (int i = 0; i < modules; ++i) {
    r.modules.push_back(Module(absl::StrCat("m", i / 100, i / 10 % 10, i % 10), 1));
  }
  return r;
}

// The group's fields with one module: a commit's write.
GroupRecord OneModule(const ModuleRecord& m, uint64_t sequence) {
  GroupRecord r = Group(0, sequence);
  r.modules.push_back(m);
  return r;
}

class JournalTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(fs_.CreateDirs(kDir, 0700).ok()); }
  std::unique_ptr<StateDir> Open() {
    absl::StatusOr<std::unique_ptr<StateDir>> d = StateDir::Open(kDir, /*sync=*/true, &fs_);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }
  GroupRecord Loaded() {
    StateDir::Loaded l = Open()->LoadAll();
    EXPECT_THAT(l.refused, IsEmpty());
    EXPECT_THAT(l.groups, SizeIs(1));
    return l.groups.empty() ? GroupRecord() : l.groups[0];
  }
  static std::vector<uint64_t> Generations(const GroupRecord& r) {
    std::vector<uint64_t> out;
    for (const ModuleRecord& m : r.modules) out.push_back(m.ranks[0].generation);
    return out;
  }
  std::string File() const { return absl::StrCat(kDir, "/", RecordFileName("g")); }
  std::string Journal() const { return absl::StrCat(kDir, "/", JournalFileName("g")); }
  InMemoryFileSystem fs_;
};

TEST_F(JournalTest, AModuleWriteAppendsOneFrameWithOneFsyncWhateverTheNumberOfModules) {
  for (int modules : {10, 1000}) {
    SCOPED_TRACE(modules);
    std::unique_ptr<StateDir> d = Open();
    ASSERT_TRUE(d->Write(Group(modules, 1)).ok());
    const std::string base = *fs_.ReadFile(File());
    const int syncs = fs_.Calls(Op::kSync), creates = fs_.Calls(Op::kCreate);
    const int64_t journal = static_cast<int64_t>(fs_.ReadFile(Journal())->size());
    ASSERT_TRUE(d->WriteModules(OneModule(Module("m005", 2), 2), {"m005"}).ok());
    EXPECT_EQ(fs_.Calls(Op::kSync), syncs + 1);
    EXPECT_EQ(fs_.Calls(Op::kCreate), creates);  // no temp file, no new base
    EXPECT_EQ(*fs_.ReadFile(File()), base);
    const int64_t appended = static_cast<int64_t>(fs_.ReadFile(Journal())->size()) - journal;
    EXPECT_LT(appended, 1000) << "the frame carries the one module, not the group";
    GroupRecord back = Loaded();
    ASSERT_THAT(back.modules, SizeIs(modules));
    EXPECT_EQ(back.modules[5].ranks[0].generation, 2u);
    EXPECT_EQ(back.modules[4].ranks[0].generation, 1u);
    EXPECT_EQ(back.sequence, 2u);
    ASSERT_TRUE(d->Remove("g", 3).ok());
  }
}

TEST_F(JournalTest, AKillAtAnyByteOfAnAppendKeepsEveryEarlierWrite) {
  {
    std::unique_ptr<StateDir> d = Open();
    ASSERT_TRUE(d->Write(Group(3, 1)).ok());
    ASSERT_TRUE(d->WriteModules(OneModule(Module("m000", 2), 2), {"m000"}).ok());
  }
  const std::string before = *fs_.ReadFile(Journal());
  {
    std::unique_ptr<StateDir> d = Open();
    d->LoadAll();
    ASSERT_TRUE(d->WriteModules(OneModule(Module("m001", 3), 3), {"m001"}).ok());
  }
  const std::string after = *fs_.ReadFile(Journal());
  ASSERT_GT(after.size(), before.size());
  // Every prefix of the last frame (and a flipped byte in it): the write before is intact.
  for (size_t cut = before.size(); cut <= after.size(); ++cut) {
    SCOPED_TRACE(cut);
    fs_.SetFile(Journal(), after.substr(0, cut));
    const bool whole = cut == after.size();
    EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{2, whole ? 3u : 1u, 1}));
  }
  std::string flipped = after;
  flipped[after.size() - 10] ^= 0x01;
  fs_.SetFile(Journal(), flipped);
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{2, 1, 1}));
  // After a torn tail the next write starts a new base: nothing is appended after garbage.
  std::unique_ptr<StateDir> d = Open();
  d->LoadAll();
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m002", 4), 4), {"m002"}).ok());
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{2, 1, 4}));
  EXPECT_EQ(*fs_.ReadFile(Journal()), "");
}

TEST_F(JournalTest, SyncedAppendsSurviveAPowerLoss) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Group(2, 1)).ok());
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m001", 2), 2), {"m001"}).ok());
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m000", 3), 3), {"m000"}).ok());
  fs_.PowerLoss();
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{3, 2}));
}

TEST_F(JournalTest, StaleWritesOfAPartNeverOverwriteANewerOne) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Group(2, 1)).ok());
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m000", 3), 5), {"m000"}).ok());
  // A module write taken before the one written: skipped.
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m000", 2), 4), {"m000"}).ok());
  // A whole-group snapshot taken before m000's commit was written, adding module "new":
  // "new" goes in, m000 keeps its newer commit.
  GroupRecord older = Group(2, 3);
  older.modules.push_back(Module("new", 1));
  ASSERT_TRUE(d->Write(older).ok());
  GroupRecord back = Loaded();
  ASSERT_THAT(back.modules, SizeIs(3));
  EXPECT_EQ(back.modules[0].name, "m000");
  EXPECT_EQ(back.modules[0].ranks[0].generation, 3u);
  EXPECT_EQ(back.modules[2].name, "new");
  // A module write that lacks the module drops it; the last one dropped removes the group.
  ASSERT_TRUE(d->WriteModules(Group(0, 6), {"new"}).ok());
  EXPECT_THAT(Loaded().modules, SizeIs(2));
  ASSERT_TRUE(d->Write(Group(0, 7)).ok());
  EXPECT_THAT(Open()->LoadAll().groups, IsEmpty());
}

TEST_F(JournalTest, TheJournalIsCompactedIntoANewBaseAndItsOldFramesAreStale) {
  std::unique_ptr<StateDir> d = Open();
  d->SetMinCompactBytes(256 << 10);  // (the default's 4 MiB would take 7,000 writes here)
  ASSERT_TRUE(d->Write(Group(4, 1)).ok());
  uint64_t seq = 1;
  int rewrites = 0;
  std::string base = *fs_.ReadFile(File());
  for (int i = 0; i < 2000; ++i) {
    const std::string name = absl::StrCat("m00", i % 4);
    ASSERT_TRUE(d->WriteModules(OneModule(Module(name, i + 2), ++seq), {name}).ok());
    if (std::string now = *fs_.ReadFile(File()); now != base) {
      ++rewrites;
      base = now;
      EXPECT_LT(fs_.ReadFile(Journal())->size(), 1000u) << "a new base starts a new journal";
    }
  }
  EXPECT_GE(rewrites, 1);
  EXPECT_LE(rewrites, 20) << "compaction is amortized over many appends";
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{1998, 1999, 2000, 2001}));
  // A kill after a new base is in place but before its journal was truncated: the old
  // journal's frames name the old base and are ignored.
  const std::string journal = *fs_.ReadFile(Journal());
  ASSERT_TRUE(d->Write(Group(4, ++seq)).ok());  // every module back to generation 1
  fs_.SetFile(Journal(), journal);
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{1, 1, 1, 1}));
}

TEST_F(JournalTest, AFrameThatChecksOutButNamesAnotherGroupRefusesTheRecord) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Group(1, 1)).ok());
  GroupRecord other = OneModule(Module("m000", 2), 2);
  other.id = "other";
  JournalFrame f;
  f.base = 1;
  f.sequence = 2;
  f.group = other;
  fs_.SetFile(Journal(), EncodeJournalFrame(f));
  StateDir::Loaded l = Open()->LoadAll();
  EXPECT_THAT(l.groups, IsEmpty());
  ASSERT_THAT(l.refused, SizeIs(1));
  EXPECT_THAT(l.refused[0].why, HasSubstr(Journal()));
  EXPECT_THAT(l.refused[0].why, HasSubstr("names group \"other\""));
}

TEST_F(JournalTest, ABaseFromBeforeTheJournalIgnoresAJournalBesideIt) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Group(2, 1)).ok());
  ASSERT_TRUE(d->WriteModules(OneModule(Module("m000", 2), 2), {"m000"}).ok());
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{2, 1}));
  // The base rewritten whole by a daemon from before the journal (/1): it holds everything.
  std::string v1 = *fs_.ReadFile(File());
  v1.replace(v1.find("flatshard.state/4"), 17, "flatshard.state/1");
  fs_.SetFile(File(), v1);
  EXPECT_EQ(Generations(Loaded()), (std::vector<uint64_t>{1, 1}));
}

TEST_F(JournalTest, AJournalWithoutItsRecordIsRemovedAtOpen) {
  fs_.SetFile(Journal(), "leftover");
  Open();
  EXPECT_FALSE(fs_.FileExists(Journal()));
}

}  // namespace
}  // namespace flatshard::server::state
