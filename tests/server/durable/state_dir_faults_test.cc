// StateDir (server/durable/state_dir.h) on InMemoryFileSystem: records, commit intents,
// ordering, refused records, failed writes, a kill between write and rename, power loss.
// No disk, no processes.

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/in_memory_file_system.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"

namespace flatshard::server::state {
namespace {

using Op = InMemoryFileSystem::Op;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::testing::UnorderedElementsAre;

constexpr char kDir[] = "/var/lib/flatshard/state";

GroupRecord Record(const std::string& id, uint64_t sequence) {
  GroupRecord r;
  r.id = id;
  r.world_size = 2;
  r.token = "tok";
  r.owner_uid = 1000;
  r.coordinator = "10.0.0.1:7451";
  r.local_ranks = {0, 1};
  r.epoch = 1;
  r.sequence = sequence;
  ModuleRecord m;
  m.name = "enc";
  m.plan_json = R"({"format":"flatshard.plan/1"})";
  m.manifest_json = R"({"format":"flatshard.manifest/1"})";
  m.initialized = true;
  for (int32_t rank : {0, 1}) {
    m.ranks.push_back(RankRecord{
        rank, sequence, {UnitRecord{0, {{kRoleShard, absl::StrCat("/fs.1.", rank), 64}}}}});
  }
  r.modules.push_back(m);
  return r;
}

std::string FileOf(const std::string& group) {
  return absl::StrCat(kDir, "/", RecordFileName(group));
}

std::string JournalOf(const std::string& group) {
  return absl::StrCat(kDir, "/", JournalFileName(group));
}

class StateDirFaultsTest : public ::testing::Test {
 protected:
  std::unique_ptr<StateDir> Open(bool sync = true) {
    absl::StatusOr<std::unique_ptr<StateDir>> d = StateDir::Open(kDir, sync, &fs_);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }
  // The sequences of the records a restarted daemon would load.
  std::vector<uint64_t> LoadedSequences() {
    std::vector<uint64_t> out;
    for (const GroupRecord& g : Open()->LoadAll().groups) out.push_back(g.sequence);
    return out;
  }
  InMemoryFileSystem fs_;
};

TEST_F(StateDirFaultsTest, RecordsRoundTripIn0600FilesOfA0700Directory) {
  std::unique_ptr<StateDir> d = Open();
  const GroupRecord a = Record("a", 3), b = Record("b", 4);
  ASSERT_TRUE(d->Write(a).ok());
  ASSERT_TRUE(d->Write(b).ok());
  EXPECT_EQ(fs_.Mode(kDir), 0700);
  EXPECT_EQ(fs_.Mode(FileOf("a")), 0600);
  EXPECT_EQ(*fs_.ReadFile(FileOf("a")), EncodeGroupRecord(a));
  std::unique_ptr<StateDir> again = Open();
  StateDir::Loaded loaded = again->LoadAll();
  EXPECT_THAT(loaded.groups, UnorderedElementsAre(a, b));
  EXPECT_TRUE(loaded.refused.empty());
  EXPECT_EQ(again->max_loaded_sequence(), 4u);
}

TEST_F(StateDirFaultsTest, CommitIntentsRoundTrip) {
  GroupRecord r = Record("g", 9);
  ModuleRecord second = r.modules[0];
  second.name = "dec";
  r.modules.push_back(second);
  r.modules[0].pending = PendingCommit{7, "commit", {0, 1}, {1}};
  r.modules[1].pending = PendingCommit{2, "load", {1}, {}};
  for (const std::string kind : {"commit", "end", "init", "load"}) {
    SCOPED_TRACE(kind);
    r.modules[0].pending->kind = kind;
    ++r.sequence;
    ASSERT_TRUE(Open()->Write(r).ok());
    StateDir::Loaded loaded = Open()->LoadAll();
    ASSERT_EQ(loaded.groups.size(), 1u);
    EXPECT_EQ(loaded.groups[0], r);
    ASSERT_TRUE(loaded.groups[0].modules[0].pending.has_value());
    EXPECT_EQ(loaded.groups[0].modules[0].pending->done_ranks, std::vector<int32_t>{1});
  }
  r.modules[0].pending.reset();  // the commit finished: the intent is gone
  ++r.sequence;
  ASSERT_TRUE(Open()->Write(r).ok());
  EXPECT_FALSE(Open()->LoadAll().groups.at(0).modules[0].pending.has_value());
}

TEST_F(StateDirFaultsTest, AStaleSequenceNeverOverwritesANewerOne) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Record("g", 5)).ok());
  const int writes = fs_.Calls(Op::kCreate);
  ASSERT_TRUE(d->Write(Record("g", 3)).ok());  // a snapshot taken before the one written
  ASSERT_TRUE(d->Write(Record("g", 5)).ok());  // the same one again
  EXPECT_EQ(fs_.Calls(Op::kCreate), writes);   // not even a temp file
  EXPECT_EQ(*fs_.ReadFile(FileOf("g")), EncodeGroupRecord(Record("g", 5)));
  EXPECT_THAT(LoadedSequences(), ElementsAre(5u));
}

TEST_F(StateDirFaultsTest, TornPartialAndCorruptRecordsAreRefusedNamingFileAndCheck) {
  ASSERT_TRUE(Open()->Write(Record("good", 1)).ok());
  const std::string bytes = EncodeGroupRecord(Record("torn", 2));
  std::string flipped = EncodeGroupRecord(Record("flipped", 3));
  flipped[flipped.size() - 3] ^= 0x04;
  fs_.SetFile(FileOf("torn"), bytes.substr(0, bytes.size() / 2));         // cut in the body
  fs_.SetFile(FileOf("partial"), bytes.substr(0, bytes.find('\n') / 2));  // cut in the header
  fs_.SetFile(FileOf("flipped"), flipped);
  fs_.SetFile(FileOf("empty"), "");
  fs_.SetFile(absl::StrCat(kDir, "/notes.txt"), "not a record: never read");

  std::unique_ptr<StateDir> d = Open();
  StateDir::Loaded loaded = d->LoadAll();
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0].id, "good");
  std::map<std::string, std::string> why;
  for (const StateDir::Refused& r : loaded.refused) why[r.file] = r.why;
  EXPECT_EQ(why.size(), 4u);
  EXPECT_THAT(why[FileOf("torn")], StartsWith("size:"));
  EXPECT_THAT(why[FileOf("partial")], StartsWith("header"));
  EXPECT_THAT(why[FileOf("flipped")], StartsWith("checksum:"));
  EXPECT_THAT(why[FileOf("empty")], StartsWith("header"));
}

TEST_F(StateDirFaultsTest, AnUnreadableRecordIsRefusedNamingTheReadError) {
  ASSERT_TRUE(Open()->Write(Record("g", 1)).ok());
  fs_.FailNext(Op::kRead, absl::InternalError("Input/output error"));
  StateDir::Loaded loaded = Open()->LoadAll();
  EXPECT_TRUE(loaded.groups.empty());
  ASSERT_EQ(loaded.refused.size(), 1u);
  EXPECT_EQ(loaded.refused[0].file, FileOf("g"));
  EXPECT_EQ(loaded.refused[0].why,
            absl::StrCat("read: read ", FileOf("g"), ": Input/output error"));
}

TEST_F(StateDirFaultsTest, AFailedWriteLeavesTheOldRecordIntactAndCanBeRetried) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Record("g", 1)).ok());
  for (Op op : {Op::kCreate, Op::kAppend, Op::kSync, Op::kClose, Op::kRename}) {
    SCOPED_TRACE(static_cast<int>(op));
    fs_.FailNext(op, absl::InternalError("injected"));
    absl::Status s = d->Write(Record("g", 2));
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), StartsWith("state record " + FileOf("g") + ": "));
    EXPECT_THAT(std::string(s.message()), HasSubstr("injected"));
    EXPECT_THAT(LoadedSequences(), ElementsAre(1u));
    // No temp file left: the record and the journal its first write began.
    EXPECT_THAT(fs_.Files(), UnorderedElementsAre(FileOf("g"), JournalOf("g")));
  }
  ASSERT_TRUE(d->Write(Record("g", 2)).ok());  // the failed sequence was not taken
  EXPECT_THAT(LoadedSequences(), ElementsAre(2u));
}

TEST_F(StateDirFaultsTest, AKillBetweenWriteAndRenameKeepsTheOldRecordAndOpenClearsTheTemp) {
  ASSERT_TRUE(Open()->Write(Record("g", 1)).ok());
  fs_.KillAt(Op::kRename);
  EXPECT_FALSE(Open()->Write(Record("g", 2)).ok());
  fs_.Restart();
  // The record, its journal and the finished-but-unpublished temp.
  ASSERT_EQ(fs_.Files().size(), 3u);
  std::unique_ptr<StateDir> d = Open();
  EXPECT_THAT(fs_.Files(), UnorderedElementsAre(FileOf("g"), JournalOf("g")));
  EXPECT_THAT(LoadedSequences(), ElementsAre(1u));
}

TEST_F(StateDirFaultsTest, SyncedRecordsAndRemovalsSurviveAPowerLoss) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Record("g", 1)).ok());
  ASSERT_TRUE(d->Write(Record("h", 1)).ok());
  ASSERT_TRUE(d->Write(Record("g", 2)).ok());
  ASSERT_TRUE(d->Remove("h", 3).ok());
  fs_.PowerLoss();
  StateDir::Loaded loaded = Open()->LoadAll();
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0], Record("g", 2));
}

TEST_F(StateDirFaultsTest, UnsyncedRecordsMayBeLostToAPowerLossButNeverTorn) {
  ASSERT_TRUE(Open()->Write(Record("g", 1)).ok());
  std::unique_ptr<StateDir> d = Open(/*sync=*/false);
  ASSERT_TRUE(d->Write(Record("g", 2)).ok());
  ASSERT_TRUE(d->Write(Record("h", 1)).ok());
  fs_.PowerLoss();
  StateDir::Loaded loaded = Open()->LoadAll();
  EXPECT_TRUE(loaded.refused.empty());
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0], Record("g", 1));
}

TEST_F(StateDirFaultsTest, RemoveAndWriteAreOrderedBySequence) {
  std::unique_ptr<StateDir> d = Open();
  ASSERT_TRUE(d->Write(Record("g", 5)).ok());
  ASSERT_TRUE(d->Remove("g", 4).ok());  // older than the record: skipped
  EXPECT_THAT(LoadedSequences(), ElementsAre(5u));
  fs_.FailNext(Op::kRemove, absl::InternalError("EROFS"));
  absl::Status s = d->Remove("g", 6);
  EXPECT_EQ(s.message(),
            absl::StrCat("state record ", FileOf("g"), ": unlink ", FileOf("g"), ": EROFS"));
  EXPECT_THAT(LoadedSequences(), ElementsAre(5u));
  ASSERT_TRUE(d->Remove("g", 6).ok());  // the retry
  EXPECT_TRUE(LoadedSequences().empty());
  ASSERT_TRUE(d->Remove("g", 7).ok());         // nothing there: fine
  ASSERT_TRUE(d->Write(Record("g", 7)).ok());  // not newer than the removal: skipped
  EXPECT_TRUE(LoadedSequences().empty());
  ASSERT_TRUE(d->Write(Record("g", 8)).ok());
  EXPECT_THAT(LoadedSequences(), ElementsAre(8u));
}

TEST_F(StateDirFaultsTest, SegmentsNamedByKeepLoadedAndRefusedRecordsSegments) {
  ASSERT_TRUE(Open()->Write(Record("g", 1)).ok());
  GroupRecord other = Record("bad", 2);
  other.modules[0].ranks[0].units[0].buffers[0].segment = "/fs.2.0";
  other.modules[0].ranks[1].units[0].buffers[0].segment = "/other.2.1";
  std::string bytes = EncodeGroupRecord(other);
  bytes[bytes.size() - 2] ^= 0x01;  // refused by its checksum; its segments stay
  fs_.SetFile(FileOf("bad"), bytes);
  std::unique_ptr<StateDir> d = Open();
  StateDir::Loaded loaded = d->LoadAll();
  ASSERT_EQ(loaded.refused.size(), 1u);
  EXPECT_THAT(d->SegmentsNamedBy(loaded, "fs"),
              UnorderedElementsAre("/fs.1.0", "/fs.1.1", "/fs.2.0"));
}

// Written by the StateDir before the FileSystem seam (commit c955e95): a daemon restarted on it
// adopts it, and today's writer writes the same bytes but the format (/2: a journal goes with
// it, so a daemon from before the journal refuses it rather than adopt an older state).
constexpr char kOldRecord[] =
    R"rec({"format":"flatshard.state/1","body_bytes":870,"body_sha256":"be6f42752c913bbe70)rec"
    R"rec(052ef14dafd14182db9cb564ac505c8a86ef16c9c99ba9"})rec"
    "\n"
    R"rec({"group":"job-1","world_size":2,"token":"t0k","owner_uid":1000,"coordinator":"10)rec"
    R"rec(.0.0.1:7451","local_ranks":[0,1],"epoch":2,"sequence":11,"modules":[{"name":"enc)rec"
    R"rec(","plan":"{\"format\":\"flatshard.plan/1\"}","manifest":"{\"format\":\"flatshard)rec"
    R"rec(.manifest/1\"}","initialized":true,"pending":{"generation":4,"kind":"commit","re)rec"
    R"rec(ady_ranks":[0,1],"done_ranks":[0]},"ranks":[{"rank":0,"generation":3,"units":[{")rec"
    R"rec(unit":0,"buffers":[{"role":"shard","segment":"/fs.9.0","bytes":64},{"role":"comm)rec"
    R"rec(itted","segment":"/fs.9.10","bytes":64},{"role":"state:exp_avg","segment":"/fs.9)rec"
    R"rec(.20","bytes":64}]}]},{"rank":1,"generation":3,"units":[{"unit":0,"buffers":[{"ro)rec"
    R"rec(le":"shard","segment":"/fs.9.1","bytes":64},{"role":"committed","segment":"/fs.9)rec"
    R"rec(.11","bytes":64},{"role":"state:exp_avg","segment":"/fs.9.21","bytes":64}]}]}],")rec"
    R"rec(state_specs":[{"name":"exp_avg","dtype":"float32","shape":"shard"}]}]})rec";

GroupRecord OldRecordsGroup() {
  GroupRecord r;
  r.id = "job-1";
  r.world_size = 2;
  r.token = "t0k";
  r.owner_uid = 1000;
  r.coordinator = "10.0.0.1:7451";
  r.local_ranks = {0, 1};
  r.epoch = 2;
  r.sequence = 11;
  ModuleRecord m;
  m.name = "enc";
  m.plan_json = R"({"format":"flatshard.plan/1"})";
  m.manifest_json = R"({"format":"flatshard.manifest/1"})";
  m.initialized = true;
  m.pending = PendingCommit{4, "commit", {0, 1}, {0}};
  m.state_specs = {{"exp_avg", DType::kFloat32, StateShape::kShard}};
  for (int32_t rank : {0, 1}) {
    m.ranks.push_back(
        RankRecord{rank,
                   3,
                   {UnitRecord{0,
                               {{kRoleShard, absl::StrCat("/fs.9.", rank), 64},
                                {kRoleCommitted, absl::StrCat("/fs.9.1", rank), 64},
                                {"state:exp_avg", absl::StrCat("/fs.9.2", rank), 64}}}}});
  }
  r.modules.push_back(m);
  return r;
}

TEST_F(StateDirFaultsTest, ARecordOfTheOldWriterIsAdoptedAndWrittenByteForByte) {
  ASSERT_TRUE(fs_.CreateDirs(kDir, 0700).ok());
  fs_.SetFile(FileOf("job-1"), kOldRecord);
  std::unique_ptr<StateDir> d = Open();
  StateDir::Loaded loaded = d->LoadAll();
  ASSERT_TRUE(loaded.refused.empty()) << loaded.refused[0].why;
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0], OldRecordsGroup());
  EXPECT_EQ(d->max_loaded_sequence(), 11u);

  InMemoryFileSystem fresh;
  absl::StatusOr<std::unique_ptr<StateDir>> again = StateDir::Open(kDir, true, &fresh);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->Write(OldRecordsGroup()).ok());
  std::string now = kOldRecord;
  now.replace(now.find("flatshard.state/1"), 17, "flatshard.state/4");
  EXPECT_EQ(*fresh.ReadFile(FileOf("job-1")), now);
}

TEST_F(StateDirFaultsTest, OpenRefusesAFileNamingThePath) {
  ASSERT_TRUE(fs_.CreateDirs("/var/lib/flatshard", 0755).ok());
  fs_.SetFile(kDir, "not a directory");
  absl::StatusOr<std::unique_ptr<StateDir>> d = StateDir::Open(kDir, true, &fs_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr(absl::StrCat("--state_dir ", kDir)));
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("not a directory"));
}

}  // namespace
}  // namespace flatshard::server::state
