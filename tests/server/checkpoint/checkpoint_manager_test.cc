// Checkpoints through GroupManager in process (README "Checkpoints"; GroupManagerHarness: a real
// ShardStore, the in-process backend, a FakeClock, no daemon): SaveCheckpoint writes the
// committed step of a module into a temp dir in flatshard.checkpoint/1, LoadCheckpoint brings it
// back (bit for bit, into the same or another world size and wrap policy) as a committed step
// that every rank must read again before its next commit; damaged checkpoints are refused,
// naming the file, before any shard changes; a save holds one generation: it waits for a
// commit's copies in flight, and a commit landing during the save waits for its data files.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checkpoint/checkpoint.h"
#include "common/plan.h"
#include "common/state_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/group_manager.h"
#include "server/shard_store.h"
#include "tests/server/testing/group_manager_harness.h"

namespace flatshard::server {
namespace {

using testing::CommitCall;
using ::testing::ElementsAre;
using testing::Eventually;
using testing::FloatCount;
using testing::Floats;
using ::testing::HasSubstr;
using testing::HoldsStep;
using testing::StepValue;
using testing::WriteStep;

using CheckpointArgs = GroupManager::CheckpointArgs;
using CheckpointProgress = GroupManager::CheckpointProgress;
using CheckpointResult = GroupManager::CheckpointResult;

// Every byte of one rank's durable state: per unit its shard, then its optimizer state buffers.
std::vector<std::string> BytesOf(const std::vector<UnitShard>& shards) {
  std::vector<std::string> out;
  for (const UnitShard& s : shards) {
    out.emplace_back(static_cast<const char*>(s.shard->data()), s.shard->bytes());
    for (const auto& b : s.state) out.emplace_back(static_cast<const char*>(b->data()), b->bytes());
  }
  return out;
}

// The parameters of TestModel by FQN, and the value of element k of each in these tests.
float ParamValue(const std::string& fqn, int64_t k) {
  static const std::map<std::string, int> kBase = {{"scale", 100},
                                                   {"enc.bias", 200},
                                                   {"enc.l1.weight", 300},
                                                   {"enc.l2.weight", 400},
                                                   {"head.weight", 500}};
  return static_cast<float>(kBase.at(fqn) + k);
}

class CheckpointManagerTest : public testing::GroupManagerHarness {
 protected:
  // A save or load of module "" of `group` by a privileged caller (root or the daemon's uid).
  static CheckpointArgs ArgsFor(const std::string& group, const std::string& dir) {
    CheckpointArgs a;
    a.group = group;
    a.module = "";
    a.dir = dir;
    a.privileged = true;
    a.wait = absl::Seconds(10);
    return a;
  }
  absl::StatusOr<CheckpointResult> Save(const std::string& group, const std::string& dir) {
    CheckpointProgress progress;
    return gm_->SaveCheckpoint(ArgsFor(group, dir), &progress);
  }
  absl::StatusOr<CheckpointResult> Load(const std::string& group, const std::string& dir) {
    CheckpointProgress progress;
    return gm_->LoadCheckpoint(ArgsFor(group, dir), &progress);
  }

  // Writes ParamValue into the elements of every parameter that `rank`'s shards hold (padding
  // stays zero), as of `plan`.
  static void WriteParams(const Plan& plan, const std::vector<UnitShard>& shards, int rank) {
    for (const UnitShard& s : shards) {
      const PlanUnit& u = plan.units[s.unit];
      for (const PlanParam& p : u.params) {
        for (int64_t k = 0; k < p.numel; ++k) {
          const int64_t j = p.offset + k - rank * u.shard_numel;
          if (j >= 0 && j < u.shard_numel) Floats(*s.shard)[j] = ParamValue(p.fqn, k);
        }
      }
    }
  }
  // Every parameter of the model, in the full buffers a read-only summon of every rank shows,
  // holds ParamValue.
  ::testing::AssertionResult ParamsHold(const std::vector<Caller>& c, const Plan& plan) {
    std::vector<std::vector<float>> full = ReadAll(c);
    if (full.size() != plan.units.size()) {
      return ::testing::AssertionFailure() << full.size() << " units read";
    }
    for (const PlanUnit& u : plan.units) {
      for (const PlanParam& p : u.params) {
        for (int64_t k = 0; k < p.numel; ++k) {
          if (full[u.index][p.offset + k] != ParamValue(p.fqn, k)) {
            return ::testing::AssertionFailure()
                   << p.fqn << " element " << k << " holds " << full[u.index][p.offset + k]
                   << " in unit " << u.index << " of a world of " << c.size();
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  // Reads the "shard" tensors of the checkpoint in `dir` (every rank and unit) and checks that
  // each holds step `step`'s values (StepValue).
  static ::testing::AssertionResult CheckpointHoldsStep(const std::string& dir, uint64_t step) {
    absl::StatusOr<checkpoint::Checkpoint> ckpt = checkpoint::OpenCheckpoint(dir);
    if (!ckpt.ok()) return ::testing::AssertionFailure() << ckpt.status();
    if (ckpt->meta.generation != step) {
      return ::testing::AssertionFailure() << "generation " << ckpt->meta.generation;
    }
    for (int32_t rank = 0; rank < ckpt->meta.world_size; ++rank) {
      for (const PlanUnit& u : ckpt->meta.plan.units) {
        const checkpoint::TensorEntry* t =
            ckpt->meta.FindTensor(rank, u.index, checkpoint::kShardTensor);
        if (t == nullptr) return ::testing::AssertionFailure() << "no shard " << rank;
        std::vector<float> got(t->bytes / 4);
        absl::Status s = checkpoint::ReadFileRange(*ckpt, rank, t->offset, t->bytes, got.data());
        if (!s.ok()) return ::testing::AssertionFailure() << s;
        for (size_t i = 0; i < got.size(); ++i) {
          if (got[i] != StepValue(step, rank, u.index, static_cast<int64_t>(i))) {
            return ::testing::AssertionFailure()
                   << dir << ": rank " << rank << " unit " << u.index << " element " << i
                   << " holds " << got[i] << ", not step " << step << "'s";
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  // Ranks 0 and 1 of "g" join and register the test model; step 1 is committed.
  std::vector<Caller> TrainOneStep(std::vector<RegisterResult>* regs) {
    std::vector<Caller> c = JoinAndRegister("g", 2, regs);
    for (int r = 0; r < 2; ++r) WriteStep((*regs)[r].shards, 1, r);
    for (absl::StatusOr<uint64_t>& g : CommitAll(c)) EXPECT_TRUE(g.ok()) << g.status();
    return c;
  }
};

TEST_F(CheckpointManagerTest, SaveModifyLoadIsBitExactAndMarksRanksStale) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  // With optimizer state: a SHARD state and a SCALAR one of another dtype.
  const std::vector<StateSpec> specs = {{"exp_avg", DType::kFloat32, StateShape::kShard},
                                        {"step", DType::kFloat64, StateShape::kScalar}};
  std::vector<std::vector<UnitShard>> shards;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterStateResult> s = gm_->RegisterState(c[r], "", specs);
    ASSERT_TRUE(s.ok()) << s.status();
    shards.push_back(s->shards);
  }
  // Step `step`'s values in every element of a parameter (trainers never write the padding).
  auto write = [&](uint64_t step) {
    for (int r = 0; r < 2; ++r) {
      for (const UnitShard& u : shards[r]) {
        const PlanUnit& unit = regs[r].plan.units[u.unit];
        for (int64_t i = 0; i < unit.shard_numel; ++i) {
          if (r * unit.shard_numel + i >= unit.numel) continue;
          Floats(*u.shard)[i] = StepValue(step, r, u.unit, i);
          Floats(*u.state[0])[i] = -StepValue(step, r, u.unit, i);
        }
        *static_cast<double*>(u.state[1]->data()) = step + 0.5;
      }
    }
  };
  write(1);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  std::vector<std::vector<std::string>> saved = {BytesOf(shards[0]), BytesOf(shards[1])};

  const std::string dir = MakeTempDir("ckpt") + "/ckpt";
  absl::StatusOr<CheckpointResult> s = Save("g", dir);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->generation, 1u);
  EXPECT_EQ(s->files, 2);
  EXPECT_EQ(s->ranks, 2);
  EXPECT_GT(s->bytes, 0);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_THAT(names,
              ElementsAre("metadata.json", "rank-00000-of-00002.bin", "rank-00001-of-00002.bin"));

  // Another step on top, committed.
  write(2);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 2u);
  }
  ASSERT_NE(BytesOf(shards[0]), saved[0]);

  absl::StatusOr<CheckpointResult> l = Load("g", dir);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->generation, 1u);
  EXPECT_EQ(l->ranks, 2);
  EXPECT_EQ(l->files, 2);
  EXPECT_EQ(GenerationOf("g"), 1u);
  // The load marked every rank stale: a commit before reading the views is refused.
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
    EXPECT_THAT(g.status().message(), HasSubstr("read them again"));
  }
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(c[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->generation, 1u);
    EXPECT_EQ(BytesOf(v->shards), saved[r]) << "rank " << r << ": not bit for bit";
  }
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 2u);
  }
}

TEST_F(CheckpointManagerTest, LoadIntoAnotherWorldSizeAndWrapPolicyReshardsByName) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  for (int r = 0; r < 2; ++r) WriteParams(regs[r].plan, regs[r].shards, r);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(ParamsHold(c, regs[0].plan));
  const std::string dir = MakeTempDir("ckpt") + "/ckpt";
  ASSERT_TRUE(Save("g", dir).ok());

  // World 3 (every unit split otherwise), world 1 under another wrap policy (other units).
  struct Case {
    std::string group;
    int world;
    const char* policy;
  };
  const char* kLinearOnly =
      R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Linear"]}})";
  for (const Case& k : {Case{"h", 3, testing::kTestPolicy}, Case{"w", 1, kLinearOnly}}) {
    SCOPED_TRACE(k.group);
    model_.policy = k.policy;
    std::vector<RegisterResult> other;
    std::vector<Caller> oc = JoinAndRegister(k.group, k.world, &other);
    ASSERT_EQ(other.size(), static_cast<size_t>(k.world));
    absl::StatusOr<CheckpointResult> l = Load(k.group, dir);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->ranks, k.world);
    EXPECT_EQ(l->generation, 1u);
    for (const Caller& x : oc) ASSERT_TRUE(gm_->GetShards(x, "").ok());
    EXPECT_TRUE(ParamsHold(oc, other[0].plan));
  }
}

TEST_F(CheckpointManagerTest, DamagedCheckpointIsRefusedNamingTheFileAndChangesNothing) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = TrainOneStep(&regs);
  const std::string dir = MakeTempDir("ckpt") + "/ckpt";
  ASSERT_TRUE(Save("g", dir).ok());
  for (int r = 0; r < 2; ++r) WriteStep(regs[r].shards, 2, r);
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  // Nothing of the module changed and its ranks are not stale: they commit on.
  auto unchanged = [&]() -> ::testing::AssertionResult {
    if (GenerationOf("g") != 2u) {
      return ::testing::AssertionFailure() << "the generation changed";
    }
    for (int r = 0; r < 2; ++r) {
      ::testing::AssertionResult held = HoldsStep(regs[r].shards, 2, r);
      if (!held) return held;
    }
    return ::testing::AssertionSuccess();
  };

  // A flipped bit in rank 1's file.
  const std::string file1 = dir + "/rank-00001-of-00002.bin";
  std::string bytes = ::flatshard::testing::ReadFile(file1);
  ASSERT_FALSE(bytes.empty());
  auto write_file = [](const std::string& path, const std::string& content) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
  };
  std::string flipped = bytes;
  flipped[0] ^= 0x01;
  write_file(file1, flipped);
  absl::StatusOr<CheckpointResult> l = Load("g", dir);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kDataLoss) << l.status();
  EXPECT_THAT(l.status().message(), HasSubstr("rank-00001-of-00002.bin"));
  EXPECT_THAT(l.status().message(), HasSubstr("(corrupt)"));
  EXPECT_TRUE(unchanged());
  // Truncated.
  write_file(file1, bytes.substr(0, bytes.size() - 5));
  l = Load("g", dir);
  EXPECT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr("rank-00001-of-00002.bin"));
  EXPECT_THAT(l.status().message(), HasSubstr("(truncated)"));
  EXPECT_TRUE(unchanged());
  write_file(file1, bytes);
  // Without its metadata (a save that did not finish).
  std::filesystem::rename(dir + "/metadata.json", dir + "/m.json");
  l = Load("g", dir);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kFailedPrecondition) << l.status();
  EXPECT_THAT(l.status().message(), HasSubstr("metadata.json: missing (an incomplete checkpoint"));
  EXPECT_TRUE(unchanged());
  std::filesystem::rename(dir + "/m.json", dir + "/metadata.json");
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 3u);
  }
  // Repaired, it loads.
  l = Load("g", dir);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->generation, 1u);
}

// A load reads each file once into the committed copies (its staging area), checking it on the
// way, and only then copies them into the shards: a file damaged near its end (read after the
// other rank's file and the same file's first tensors landed) leaves the shards, the committed
// copies (a save after it writes the last commit) and the module's optimizer state (none: a
// checkpoint with state creates it only when it loads) as they were.
TEST_F(CheckpointManagerTest, ARefusedLoadLeavesTheCommittedCopiesAndTheStateAsTheyWere) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = JoinAndRegister("g", 2, &regs);
  const std::vector<StateSpec> specs = {{"exp_avg", DType::kFloat32, StateShape::kShard}};
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterStateResult> s = gm_->RegisterState(c[r], "", specs);
    ASSERT_TRUE(s.ok()) << s.status();
    WriteStep(regs[r].shards, 1, r);
  }
  for (absl::StatusOr<uint64_t>& g : CommitAll(c)) ASSERT_TRUE(g.ok()) << g.status();
  const std::string dir = MakeTempDir("ckpt") + "/ckpt";
  ASSERT_TRUE(Save("g", dir).ok());
  // Group "h": the same model without optimizer state, at generation 2 holding step 2.
  std::vector<RegisterResult> h_regs;
  std::vector<Caller> h = JoinAndRegister("h", 2, &h_regs);
  for (uint64_t step = 1; step <= 2; ++step) {
    for (int r = 0; r < 2; ++r) WriteStep(h_regs[r].shards, step, r);
    for (absl::StatusOr<uint64_t>& g : CommitAll(h)) ASSERT_TRUE(g.ok()) << g.status();
  }
  const std::string file1 = dir + "/rank-00001-of-00002.bin";
  const std::string bytes = ::flatshard::testing::ReadFile(file1);
  ASSERT_FALSE(bytes.empty());
  std::string flipped = bytes;
  flipped[flipped.size() - 1] ^= 0x01;
  std::ofstream(file1, std::ios::binary | std::ios::trunc) << flipped;
  absl::StatusOr<CheckpointResult> l = Load("h", dir);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kDataLoss) << l.status();
  EXPECT_THAT(l.status().message(), HasSubstr("rank-00001-of-00002.bin: CRC-32C"));
  EXPECT_EQ(GenerationOf("h"), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(HoldsStep(h_regs[r].shards, 2, r));
    absl::StatusOr<RegisterResult> v = gm_->GetShards(h[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    for (const UnitShard& sh : v->shards) EXPECT_TRUE(sh.state.empty()) << "rank " << r;
  }
  const std::string after = MakeTempDir("after") + "/ckpt";
  ASSERT_TRUE(Save("h", after).ok());
  EXPECT_TRUE(CheckpointHoldsStep(after, 2));
  // Not stale: the ranks commit on.
  for (absl::StatusOr<uint64_t>& g : CommitAll(h)) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, 3u);
  }
  // Repaired, it loads: step 1's shards and the checkpoint's optimizer state.
  std::ofstream(file1, std::ios::binary | std::ios::trunc) << bytes;
  l = Load("h", dir);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->generation, 1u);
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<RegisterResult> v = gm_->GetShards(h[r], "");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(HoldsStep(v->shards, 1, r));
    for (const UnitShard& sh : v->shards) EXPECT_EQ(sh.state.size(), 1u) << "rank " << r;
  }
}

// A save never reads a committed copy while a commit copies into it: a commit whose copies are
// in flight (held mid-copy by --testing_commit_copy_pause, its intent visible in the state
// directory) is waited for, and the save holds its generation completely.
TEST_F(CheckpointManagerTest, SaveWaitsForACommitCopyInFlight) {
  UseStateDir();
  GroupManagerOptions options;
  options.testing_commit_copy_pause = absl::Milliseconds(300);
  Start(std::move(options));
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = TrainOneStep(&regs);
  for (int r = 0; r < 2; ++r) WriteStep(regs[r].shards, 2, r);
  // The trainers commit on threads of their own (the last rank's call may run the copies).
  CommitCall commits[2];
  std::thread committer([&] {
    for (int r = 0; r < 2; ++r) gm_->Commit(c[r], "", Deadline(), commits[r].Callback());
  });
  const bool copying = Eventually([&] {
    absl::StatusOr<state::GroupRecord> rec = ReadRecord("g");
    return rec.ok() && !rec->modules.empty() && rec->modules[0].pending.has_value();
  });
  absl::StatusOr<CheckpointResult> s = absl::UnknownError("not saved");
  const std::string dir = MakeTempDir("ckpt") + "/ckpt";
  if (copying) s = Save("g", dir);
  committer.join();
  ASSERT_TRUE(copying) << "the commit's copies did not start";
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->generation, 2u);
  EXPECT_TRUE(CheckpointHoldsStep(dir, 2));
  for (CommitCall& x : commits) {
    ASSERT_TRUE(x.Wait().ok()) << x.Wait().status();
    EXPECT_EQ(*x.Wait(), 2u);
  }
}

// A commit that lands while a save writes its data files goes through only after them: the
// save holds one generation. The save is held at a gate: rank 0's data file is first written
// as "<name>.tmp", opened for writing, and here that name is a FIFO, so the writer waits in
// open() until the test opens the FIFO's other end (that save then fails: a FIFO cannot be
// written at an offset). What a save holding its generation writes is checked by
// SaveWaitsForACommitCopyInFlight.
TEST_F(CheckpointManagerTest, ACommitDuringASaveWaitsForItsDataFiles) {
  Start();
  std::vector<RegisterResult> regs;
  std::vector<Caller> c = TrainOneStep(&regs);
  const std::string dir = MakeTempDir("ckpt");
  const std::string fifo = dir + "/" + checkpoint::RankFileName(0, 2) + ".tmp";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  CheckpointProgress progress;
  absl::StatusOr<CheckpointResult> gated = absl::UnknownError("not run");
  std::thread saver([&] { gated = gm_->SaveCheckpoint(ArgsFor("g", dir), &progress); });
  // Opens the gate: with a reader the writer's open() returns (it then fails to write).
  auto open_gate = [&] {
    const int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    saver.join();
    if (fd >= 0) ::close(fd);
  };
  if (!Eventually([&] { return progress.phase.load() == CheckpointProgress::kWriting; })) {
    open_gate();
    FAIL() << "the save did not start writing: " << gated.status();
  }

  // Step 2, committed by every rank while the save holds step 1.
  for (int r = 0; r < 2; ++r) WriteStep(regs[r].shards, 2, r);
  CommitCall commits[2];
  for (int r = 0; r < 2; ++r) gm_->Commit(c[r], "", Deadline(), commits[r].Callback());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(commits[0].Done() || commits[1].Done())
      << "a commit overwrote the committed copies while a save read them";
  EXPECT_EQ(GenerationOf("g"), 1u);
  open_gate();
  EXPECT_FALSE(gated.ok()) << "the gate is a FIFO: no data file can be written there";

  // Once the save let go, the commit went through; a new save holds its generation.
  for (CommitCall& x : commits) {
    ASSERT_TRUE(x.Wait().ok()) << x.Wait().status();
    EXPECT_EQ(*x.Wait(), 2u);
  }
  const std::string next = MakeTempDir("ckpt") + "/next";
  absl::StatusOr<CheckpointResult> s = Save("g", next);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->generation, 2u);
  EXPECT_TRUE(CheckpointHoldsStep(next, 2));
}

}  // namespace
}  // namespace flatshard::server
