// Record durability per commit (README "Restarts", issue 24's target: <= 1 ms median with
// fsync, at 10 and at 1,000 registered modules): the time from a commit's record being handed
// to the state directory to it being durable, for the journal (StateDir::WriteModules: one
// frame of the committed module, one fsync) against the whole-file rewrite it replaced (the
// group's record encoded whole, written to a temp file, fsync, rename, fsync of the directory:
// WriteFileAtomically, as StateDir::Write did per commit) and a plain write+fsync of the
// journal frame's bytes, in the same run on the same disk; and a whole Commit's three frames
// as the daemon writes them (vote and end without an fsync, the intent with one). A plain main (no
// Google Benchmark). Full run:
//   build/tests/bench/flatshard_records_benchmark --dir /var/tmp
// The directory's file system decides the fsync cost: pass one on the disk that matters.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_system.h"
#include "server/durable/journal.h"
#include "server/durable/state_dir.h"

ABSL_FLAG(std::string, dir, "", "where the records go (default: a fresh directory in $TMPDIR)");
ABSL_FLAG(std::string, modules, "10,1000", "registered modules of the group, one run each");
ABSL_FLAG(int, commits, 300, "commits timed per run (after 20 untimed)");
ABSL_FLAG(int, ranks, 4, "local ranks per module (each with a shard and a committed copy)");
ABSL_FLAG(int, units, 4, "units per module");

namespace flatshard::server::state {
namespace {

using Clock = std::chrono::steady_clock;

ModuleRecord Module(int i, int ranks, int units, uint64_t generation) {
  ModuleRecord m;
  m.name = absl::StrCat("layers.", i);
  // A plan and manifest of a transformer block's size in JSON (a few KiB).
  m.plan_json =
      absl::StrCat(R"({"format":"flatshard.plan/1","pad":")", std::string(2048, 'p'), "\"}");
  m.manifest_json =
      absl::StrCat(R"({"format":"flatshard.manifest/1","pad":")", std::string(1024, 'm'), "\"}");
  m.initialized = true;
  for (int r = 0; r < ranks; ++r) {
    RankRecord rr{r, generation, {}};
    for (int u = 0; u < units; ++u) {
      const std::string base = absl::StrCat("/fsbench.1.", i, ".", r, ".", u);
      rr.units.push_back(UnitRecord{
          u, {{kRoleShard, base + ".s", 1 << 20}, {kRoleCommitted, base + ".c", 1 << 20}}});
    }
    m.ranks.push_back(std::move(rr));
  }
  return m;
}

struct Stats {
  double median_ms = 0, p99_ms = 0;
};

Stats Of(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  Stats s;
  s.median_ms = ms[ms.size() / 2];
  s.p99_ms = ms[std::min(ms.size() - 1, ms.size() * 99 / 100)];
  return s;
}

template <typename F>
Stats Time(int commits, F&& one) {
  for (int i = 0; i < 20; ++i) one(i);
  std::vector<double> ms;
  for (int i = 0; i < commits; ++i) {
    const auto t0 = Clock::now();
    one(20 + i);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return Of(std::move(ms));
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage("record durability per commit: journal vs whole-file rewrite");
  absl::ParseCommandLine(argc, argv);
  const int commits = absl::GetFlag(FLAGS_commits);
  const int ranks = absl::GetFlag(FLAGS_ranks), units = absl::GetFlag(FLAGS_units);
  std::filesystem::path root = absl::GetFlag(FLAGS_dir);
  if (root.empty()) root = std::filesystem::temp_directory_path();
  root /= absl::StrCat("fsrecbench", ::getpid());
  std::filesystem::create_directories(root);
  std::printf(
      "record durability per commit, fsync on, %s; %d commits per run, %d ranks x %d "
      "units per module\n",
      root.c_str(), commits, ranks, units);
  std::printf("%8s  %-34s %10s %10s %12s\n", "modules", "write", "median_ms", "p99_ms",
              "bytes/commit");
  bool failed = false;
  for (absl::string_view n_text : absl::StrSplit(absl::GetFlag(FLAGS_modules), ',')) {
    const int n = std::stoi(std::string(n_text));
    GroupRecord group;
    group.id = absl::StrCat("bench", n);
    group.world_size = ranks;
    group.token = absl::StrCat("token", n);
    group.local_ranks.resize(ranks);
    for (int r = 0; r < ranks; ++r) group.local_ranks[r] = r;
    group.sequence = 1;
    for (int i = 0; i < n; ++i) group.modules.push_back(Module(i, ranks, units, 1));
    const std::string dir = (root / absl::StrCat("m", n)).string();
    absl::StatusOr<std::unique_ptr<StateDir>> d = StateDir::Open(dir);
    if (!d.ok() || !(*d)->Write(group).ok()) {
      std::fprintf(stderr, "cannot set up %s\n", dir.c_str());
      return 1;
    }
    uint64_t seq = 1;
    size_t frame_bytes = 0;
    // The journal: the committed module's record (its generation moved on), one fsync.
    const Stats journal = Time(commits, [&](int i) {
      GroupRecord one;  // the group's fields and the one module (Records::SnapshotModuleLocked)
      one.id = group.id;
      one.world_size = group.world_size;
      one.token = group.token;
      one.local_ranks = group.local_ranks;
      one.modules = {Module(i % n, ranks, units, i + 2)};
      one.sequence = ++seq;
      JournalFrame f;
      f.group = one;
      frame_bytes = EncodeJournalFrame(f).size();
      if (absl::Status s = (*d)->WriteModules(one, {one.modules[0].name}); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        failed = true;
      }
    });
    // A whole Commit's records as the daemon writes them (server/durable/commit_votes.cc,
    // commit_intents.cc): the vote (no fsync), the intent (one fsync), the end (no fsync).
    const Stats commit = Time(commits, [&](int i) {
      GroupRecord one;
      one.id = group.id;
      one.world_size = group.world_size;
      one.token = group.token;
      one.local_ranks = group.local_ranks;
      ModuleRecord m = Module(i % n, ranks, units, i + 2);
      const uint64_t next = m.ranks.empty() ? 1 : m.ranks[0].generation + 1;
      m.voted = next;
      one.modules = {m};
      one.sequence = ++seq;
      bool ok = (*d)->WriteModules(one, {m.name}, /*sync=*/false).ok();
      one.modules[0].pending = PendingCommit{next, "commit", {0}, {}};
      one.sequence = ++seq;
      ok = ok && (*d)->WriteModules(one, {m.name}, /*sync=*/true).ok();
      for (RankRecord& r : one.modules[0].ranks) r.generation = next;
      one.modules[0].pending.reset();
      one.modules[0].voted = 0;
      one.sequence = ++seq;
      ok = ok && (*d)->WriteModules(one, {m.name}, /*sync=*/false).ok();
      if (!ok) failed = true;
    });
    // The same frame's bytes, appended with a plain write + fsync (the floor).
    const std::string plain_file = dir + "/plain";
    const int fd = ::open(plain_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    const std::string frame(frame_bytes, 'x');
    const Stats plain = Time(commits, [&](int) {
      if (::write(fd, frame.data(), frame.size()) != static_cast<ssize_t>(frame.size()) ||
          ::fsync(fd) != 0) {
        failed = true;
      }
    });
    ::close(fd);
    // The whole-file rewrite every commit did before the journal (encoding included, as
    // then). Fewer commits where it is slow (a fifth of them from 100 modules on).
    const std::string whole_file = dir + "/whole.json";
    size_t whole_bytes = 0;
    const Stats whole = Time(n >= 100 ? std::max(commits / 5, 20) : commits, [&](int i) {
      group.modules[i % n] = Module(i % n, ranks, units, i + 2);
      group.sequence = ++seq;
      const std::string bytes = EncodeGroupRecord(group);
      whole_bytes = bytes.size();
      if (!WriteFileAtomically(FileSystem::Posix(), whole_file, bytes).ok()) failed = true;
    });
    std::printf("%8d  %-34s %10.3f %10.3f %12zu\n", n, "journal (WriteModules)", journal.median_ms,
                journal.p99_ms, frame_bytes);
    std::printf("%8d  %-34s %10.3f %10.3f %12zu\n", n, "commit: vote+intent(fsync)+end",
                commit.median_ms, commit.p99_ms, 3 * frame_bytes);
    std::printf("%8d  %-34s %10.3f %10.3f %12zu\n", n, "plain write+fsync of the frame",
                plain.median_ms, plain.p99_ms, frame_bytes);
    std::printf("%8d  %-34s %10.3f %10.3f %12zu\n", n, "whole-file rewrite (before)",
                whole.median_ms, whole.p99_ms, whole_bytes);
  }
  std::filesystem::remove_all(root);
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace flatshard::server::state

int main(int argc, char** argv) { return flatshard::server::state::Main(argc, argv); }
