// The state directory's record codec, ordering and loading on the real file system
// (server/durable/state_dir.h). Faults, kills and power loss: state_dir_faults_test.cc.

#include "server/durable/state_dir.h"
#include "server/durable/journal.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server::state {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

// Decodes an edited record body re-sealed under a valid header, so only the body checks can
// refuse it: "accepted" or the refusal's message.
std::string WhyRefused(const std::string& body) {
  const std::string header =
      absl::StrCat(R"({"format":"flatshard.state/1","body_bytes":)", body.size(),
                   R"(,"body_sha256":")", Sha256Hex(body), "\"}\n");
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(header + body);
  return back.ok() ? std::string("accepted") : std::string(back.status().message());
}

// WhyRefused of the body of the encoded record `bytes` with its first `from` replaced by `to`.
std::string WhyEditedRefused(const std::string& bytes, const std::string& from,
                             const std::string& to) {
  std::string body = bytes.substr(bytes.find('\n') + 1);
  const size_t at = body.find(from);
  if (at == std::string::npos) return std::string("not found: ") + from;
  body.replace(at, from.size(), to);
  return WhyRefused(body);
}

GroupRecord Sample(const std::string& id = "job-17", uint64_t sequence = 7) {
  GroupRecord r;
  r.id = id;
  r.world_size = 4;
  r.token = "s3cret\"\n";
  r.owner_uid = 1000;
  r.coordinator = "10.0.0.1:7451";
  r.local_ranks = {0, 1};
  r.epoch = 3;
  r.sequence = sequence;
  ModuleRecord m;
  m.name = "encoder";
  m.plan_json = R"({"format":"flatshard.plan/1"})";
  m.manifest_json = R"({"format":"flatshard.manifest/1"})";
  m.initialized = true;
  m.pending = PendingCommit{5, "end", {0}, {}};
  for (int32_t rank : {0, 1}) {
    RankRecord rr{rank, 4, {}};
    for (int32_t u : {0, 1}) {
      UnitRecord ur{u,
                    {{kRoleShard, absl::StrCat("/fs.1.", rank * 10 + u), 64},
                     {kRoleCommitted, absl::StrCat("/fs.1.", 100 + rank * 10 + u), 64},
                     {"state:exp_avg", absl::StrCat("/fs.1.", 200 + rank * 10 + u), 64}}};
      rr.units.push_back(ur);
    }
    m.ranks.push_back(rr);
  }
  r.modules.push_back(m);
  ModuleRecord plain = m;
  plain.name = "";
  plain.pending.reset();
  r.modules.push_back(plain);
  return r;
}

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class StateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("state_dir_test.", getpid(), ".", counter_++);
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  static inline int counter_ = 0;
};

TEST(StateRecordTest, RoundTrips) {
  const GroupRecord r = Sample();
  const std::string bytes = EncodeGroupRecord(r);
  EXPECT_TRUE(absl::StartsWith(bytes, R"({"format":"flatshard.state/4")")) << bytes;
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
}

TEST(StateRecordTest, EveryFlippedBodyByteIsRefusedByTheChecksum) {
  const std::string bytes = EncodeGroupRecord(Sample());
  const size_t body = bytes.find('\n') + 1;
  for (size_t i = body; i < bytes.size(); i += 7) {
    std::string bad = bytes;
    bad[i] ^= 0x01;
    absl::StatusOr<GroupRecord> r = DecodeGroupRecord(bad);
    ASSERT_FALSE(r.ok()) << "byte " << i;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("checksum:")) << "byte " << i;
  }
}

TEST(StateRecordTest, TruncatedAppendedWrongVersionAndGarbageAreRefusedNamingTheCheck) {
  const std::string bytes = EncodeGroupRecord(Sample());
  auto why = [](const std::string& b) {
    absl::StatusOr<GroupRecord> r = DecodeGroupRecord(b);
    return r.ok() ? std::string("accepted") : std::string(r.status().message());
  };
  EXPECT_THAT(why(bytes.substr(0, bytes.size() - 10)), HasSubstr("size:"));
  EXPECT_THAT(why(bytes + " "), HasSubstr("size:"));
  EXPECT_THAT(why(bytes.substr(0, bytes.find('\n') - 3)), HasSubstr("header"));
  EXPECT_THAT(why(""), HasSubstr("header"));
  std::string v5 = bytes;
  v5.replace(v5.find("flatshard.state/4"), 17, "flatshard.state/5");
  EXPECT_THAT(why(v5), HasSubstr("version:"));
  // A base from before "deferred" (/3) still loads.
  std::string v3 = bytes;
  v3.replace(v3.find("flatshard.state/4"), 17, "flatshard.state/3");
  EXPECT_TRUE(DecodeGroupRecord(v3).ok());
  // A journaled base from before "kept" (/2) still loads, with its journal.
  std::string v2 = bytes;
  v2.replace(v2.find("flatshard.state/4"), 17, "flatshard.state/2");
  bool v2_journaled = false;
  EXPECT_TRUE(DecodeGroupRecord(v2, &v2_journaled).ok());
  EXPECT_TRUE(v2_journaled);
  // A base from before the journal (/1) still loads, and says it has no journal.
  std::string v1 = bytes;
  v1.replace(v1.find("flatshard.state/4"), 17, "flatshard.state/1");
  bool journaled = true;
  EXPECT_TRUE(DecodeGroupRecord(v1, &journaled).ok());
  EXPECT_FALSE(journaled);
}

TEST(StateRecordTest, BodyChecksRefuseBadValuesNamingThePath) {
  GroupRecord r = Sample();
  r.modules[0].ranks[1].rank = 9;  // beyond world_size 4
  absl::StatusOr<GroupRecord> bad = DecodeGroupRecord(EncodeGroupRecord(r));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("out of range"));
  r = Sample();
  r.modules[0].ranks[0].units[0].buffers[0].segment = "no-slash";
  bad = DecodeGroupRecord(EncodeGroupRecord(r));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("segment"));
}

TEST(StateRecordTest, StateSpecsRoundTripAndRecordsWithoutThemLoad) {
  GroupRecord r = Sample();
  r.modules[0].state_specs = {{"exp_avg", DType::kFloat32, StateShape::kShard},
                              {"step", DType::kInt64, StateShape::kScalar}};
  r.modules[0].pending = PendingCommit{6, "load", {0, 1}, {}};
  const std::string bytes = EncodeGroupRecord(r);
  EXPECT_THAT(bytes, HasSubstr(R"("state_specs":[{"name":"exp_avg","dtype":"float32",)"
                               R"("shape":"shard"},{"name":"step","dtype":"int64",)"
                               R"("shape":"scalar"}])"));
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
  // A record written before state was recorded (no key): no state.
  const std::string old = EncodeGroupRecord(Sample());
  EXPECT_THAT(old, Not(HasSubstr("state_specs")));
  back = DecodeGroupRecord(old);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->modules[0].state_specs.empty());
}

// A module's recorded vote (issue 24, server/durable/commit_votes.cc): round-trips, is absent
// when there is none (records without the key load with none), and a bad one is refused.
TEST(StateRecordTest, AVoteRoundTripsAndRecordsWithoutItLoad) {
  GroupRecord r = Sample();
  r.modules[0].voted = 6;
  const std::string bytes = EncodeGroupRecord(r);
  EXPECT_THAT(bytes, HasSubstr(R"("voted":6)"));
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->modules[0].voted, 6u);
  const std::string none = EncodeGroupRecord(Sample());
  EXPECT_THAT(none, Not(HasSubstr("voted")));
  back = DecodeGroupRecord(none);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->modules[0].voted, 0u);
}

// A module's kept summon buffers (adopted at a restart with their pages): round-trip, absent
// when none (older records load with none), their segments are the record's, and a bad one
// is refused naming the field.
TEST(StateRecordTest, KeptBuffersRoundTripAndBadOnesAreRefused) {
  GroupRecord r = Sample();
  r.modules[0].kept = {{1, -1, 2, 0, 2, "/fs.1.900", 4096}, {0, 1, 0, 2, 2, "/fs.1.901", 64}};
  const std::string bytes = EncodeGroupRecord(r);
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->modules[0].kept, r.modules[0].kept);
  EXPECT_THAT(SegmentNamesIn(bytes, "fs"), ::testing::Contains("/fs.1.900"));
  const std::string none = EncodeGroupRecord(Sample());
  EXPECT_THAT(none, Not(HasSubstr("kept")));
  back = DecodeGroupRecord(none);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->modules[0].kept.empty());
  auto refused = [&](const std::string& from, const std::string& to) {
    return WhyEditedRefused(bytes, from, to);
  };
  EXPECT_THAT(refused(R"("segment":"/fs.1.900")", R"("segment":"fs.1.900")"),
              HasSubstr("$.modules[0].kept[0].segment"));
  EXPECT_THAT(refused(R"("kind":2,"segment":"/fs.1.900")", R"("kind":0,"segment":"/fs.1.900")"),
              HasSubstr("$.modules[0].kept[0].kind"));
}

// A module's deferred copies (a writeback End's own ranges still to copy from a summon buffer
// into the committed copies): round-trip, absent when none, their segments are kept at
// startup, and a bad one is refused naming the field.
TEST(StateRecordTest, DeferredCopiesRoundTripAndBadOnesAreRefused) {
  GroupRecord r = Sample();
  r.modules[0].deferred = {{1, 0, 7, "/fs.1.950", 2, 8192, 4096, 0, 4096}};
  const std::string bytes = EncodeGroupRecord(r);
  absl::StatusOr<GroupRecord> back = DecodeGroupRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->modules[0].deferred, r.modules[0].deferred);
  EXPECT_THAT(SegmentNamesIn(bytes, "fs"), ::testing::Contains("/fs.1.950"));
  EXPECT_THAT(EncodeGroupRecord(Sample()), Not(HasSubstr("deferred")));
  auto refused = [&](const std::string& from, const std::string& to) {
    return WhyEditedRefused(bytes, from, to);
  };
  EXPECT_THAT(refused(R"("segment":"/fs.1.950")", R"("segment":"fs.1.950")"),
              HasSubstr("$.modules[0].deferred[0].segment"));
  EXPECT_THAT(refused(R"("src_offset":4096)", R"("src_offset":4097)"),
              HasSubstr("$.modules[0].deferred[0]: src_offset 4097 + bytes 4096 is past"));
}

TEST(StateRecordTest, BadStateSpecsAreRefusedNamingThePath) {
  auto why = [](std::vector<StateSpec> specs, const std::string& from, const std::string& to) {
    GroupRecord r = Sample();
    r.modules[1].state_specs = std::move(specs);
    return WhyEditedRefused(EncodeGroupRecord(r), from, to);
  };
  const std::vector<StateSpec> one = {{"exp_avg", DType::kFloat32, StateShape::kShard}};
  EXPECT_EQ(why(one, "", ""), "accepted");
  EXPECT_THAT(why(one, R"("dtype":"float32")", R"("dtype":"float33")"),
              HasSubstr("body: $.modules[1].state_specs[0].dtype: unknown dtype \"float33\""));
  EXPECT_THAT(why(one, R"("shape":"shard")", R"("shape":"row")"),
              HasSubstr("body: $.modules[1].state_specs[0].shape: must be shard or scalar"));
  EXPECT_THAT(why(one, R"("name":"exp_avg")", R"("name":"exp avg")"),
              HasSubstr("body: $.modules[1].state_specs"));
  EXPECT_THAT(why(one, R"("shape":"shard")", R"("shape":"shard","extra":1)"), HasSubstr("extra"));
}

TEST(StateRecordTest, FileNameIsAHashOfTheGroupId) {
  EXPECT_EQ(RecordFileName("a/../../etc/passwd").find('/'), std::string::npos);
  EXPECT_NE(RecordFileName("a"), RecordFileName("b"));
  EXPECT_EQ(RecordFileName("a"), RecordFileName("a"));
  EXPECT_TRUE(absl::StartsWith(RecordFileName("x"), "group-"));
}

TEST(StateRecordTest, SegmentNamesInFindsTheRecordsSegments) {
  const std::string bytes = EncodeGroupRecord(Sample());
  std::vector<std::string> names = SegmentNamesIn(bytes, "fs");
  EXPECT_EQ(names.size(), 2u * 2u * 2u * 3u);
  EXPECT_THAT(names, ::testing::Contains("/fs.1.0"));
  EXPECT_TRUE(SegmentNamesIn(bytes, "other").empty());
}

TEST_F(StateDirTest, OpenCreatesA0700DirectoryAndRemovesUnfinishedWrites) {
  std::filesystem::create_directories(dir_);
  ::chmod(dir_.c_str(), 0755);
  std::ofstream(dir_ / ".tmp.group-x.json.1.0") << "half";
  absl::StatusOr<std::unique_ptr<StateDir>> d = StateDir::Open(dir_.string());
  ASSERT_TRUE(d.ok()) << d.status();
  struct stat st;
  ASSERT_EQ(::stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_FALSE(std::filesystem::exists(dir_ / ".tmp.group-x.json.1.0"));

  std::ofstream(dir_ / "file") << "x";
  absl::StatusOr<std::unique_ptr<StateDir>> bad = StateDir::Open((dir_ / "file").string());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr((dir_ / "file").string()));
}

TEST_F(StateDirTest, WriteLeavesOnlyTheRecord0600) {
  std::unique_ptr<StateDir> d = *StateDir::Open(dir_.string());
  ASSERT_TRUE(d->Write(Sample("g", 1)).ok());
  ASSERT_TRUE(d->Write(Sample("g", 2)).ok());
  const std::filesystem::path file = dir_ / RecordFileName("g");
  EXPECT_EQ(ReadAll(file), EncodeGroupRecord(Sample("g", 2)));
  struct stat st;
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The record and its (empty) journal, no temp file.
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    files.push_back(e.path().filename().string());
  }
  EXPECT_THAT(files, UnorderedElementsAre(RecordFileName("g"), JournalFileName("g")));
  ASSERT_EQ(::stat((dir_ / JournalFileName("g")).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::filesystem::remove_all(dir_);  // the directory vanished under the daemon
  absl::Status gone = d->Write(Sample("g", 3));
  ASSERT_FALSE(gone.ok());
  EXPECT_THAT(std::string(gone.message()),
              HasSubstr(absl::StrCat("state record ", file.string(), ": open ")));
}

TEST_F(StateDirTest, WritesOfAGroupAreOrderedBySequence) {
  std::unique_ptr<StateDir> d = *StateDir::Open(dir_.string());
  ASSERT_TRUE(d->Write(Sample("g", 5)).ok());
  ASSERT_TRUE(d->Write(Sample("g", 3)).ok());  // stale: skipped
  StateDir::Loaded loaded = d->LoadAll();
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0].sequence, 5u);
  ASSERT_TRUE(d->Remove("g", 4).ok());  // older than the record: skipped
  EXPECT_EQ(d->LoadAll().groups.size(), 1u);
  ASSERT_TRUE(d->Remove("g", 6).ok());
  EXPECT_TRUE(d->LoadAll().groups.empty());
  ASSERT_TRUE(d->Write(Sample("g", 6)).ok());  // not newer than the removal
  EXPECT_TRUE(d->LoadAll().groups.empty());
  ASSERT_TRUE(d->Write(Sample("g", 8)).ok());
  EXPECT_EQ(d->LoadAll().groups.size(), 1u);
}

TEST_F(StateDirTest, LoadAllRefusesCorruptAndMisplacedRecordsNamingFileAndCheck) {
  std::unique_ptr<StateDir> d = *StateDir::Open(dir_.string());
  ASSERT_TRUE(d->Write(Sample("good", 2)).ok());
  ASSERT_TRUE(d->Write(Sample("bad", 9)).ok());
  const std::filesystem::path bad = dir_ / RecordFileName("bad");
  std::string bytes = ReadAll(bad);
  bytes[bytes.size() - 5] ^= 0x20;
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << bytes;
  // A valid record under another group's file name.
  std::filesystem::copy_file(dir_ / RecordFileName("good"), dir_ / RecordFileName("elsewhere"));

  std::unique_ptr<StateDir> again = *StateDir::Open(dir_.string());
  StateDir::Loaded loaded = again->LoadAll();
  ASSERT_EQ(loaded.groups.size(), 1u);
  EXPECT_EQ(loaded.groups[0].id, "good");
  EXPECT_EQ(again->max_loaded_sequence(), 2u);
  ASSERT_EQ(loaded.refused.size(), 2u);
  for (const StateDir::Refused& r : loaded.refused) {
    if (r.file == bad.string()) {
      EXPECT_THAT(r.why, HasSubstr("checksum:"));
    } else {
      EXPECT_EQ(r.file, (dir_ / RecordFileName("elsewhere")).string());
      EXPECT_THAT(r.why, HasSubstr("name:"));
    }
  }
}

}  // namespace
}  // namespace flatshard::server::state
