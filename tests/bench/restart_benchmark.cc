// Restart-to-re-attached time (README "Restarts"): a flatshardd with --state_dir holding one
// rank's shard of --bytes (one unit, world size 1) after a commit is killed with SIGKILL and
// started again; measured from the restarted daemon's exec to the trainer's successful
// re-register (join + Register re-attaching at the committed generation), and to its first
// Summon (read-only, the full unit) after it; that Summon's own time against a Summon of the
// same daemon before the kill (its second: buffers warm), as a ratio. Baselines from the same
// run: a fresh daemon (empty state directory) to a registered model of zeros of the same size
// and its first Summon, and a plain memcpy of the same bytes in this process.
//
//   build/tests/bench/flatshard_restart_benchmark [--bytes 1073741824] [--repeats 3]

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "shard bytes of the one rank (float32 elements x 4)");
ABSL_FLAG(int, repeats, 3, "restarts measured (the median is reported)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;

struct Times {
  double ready_ms = 0;              // exec to the socket accepting
  double register_ms = 0;           // exec to Register answered (join + register)
  double summon_ms = 0;             // exec to the first Summon answered
  double first_summon_call_ms = 0;  // the first Summon call alone
  double warm_summon_call_ms = 0;   // a second Summon call alone (before the kill)
};

absl::StatusOr<Times> Attach(BenchDaemon& d, const std::string& binary, const std::string& tag,
                             const std::vector<std::string>& flags, int64_t numel,
                             uint64_t want_generation, bool commit) {
  const Clock::time_point t0 = Clock::now();
  if (absl::Status s = d.Start(binary, tag, flags); !s.ok()) return s;
  Times t;
  t.ready_ms = MicrosSince(t0, Clock::now()) / 1000;
  ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(120);
  options.join_timeout = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  if (!c.ok()) return c.status();
  if (absl::Status s = (*c)->Join("bench", 1, 0, "tok"); !s.ok()) return s;
  absl::StatusOr<client::RegisteredModule> m =
      (*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros);
  if (!m.ok()) return m.status();
  t.register_ms = MicrosSince(t0, Clock::now()) / 1000;
  if (m->generation != want_generation) {
    return absl::InternalError(
        absl::StrCat("registered at generation ", m->generation, ", want ", want_generation));
  }
  if (commit) {
    // A step's values, written before its summons: the Commit below follows the summons as
    // in a training loop, so its record lists the kept summon buffers (adopted at the restart
    // with their pages).
    absl::StatusOr<client::ShardViews> v = (*c)->GetShardViews("");
    if (!v.ok()) return v.status();
    for (const client::UnitShardView& u : *v) {
      std::memset(u.data, 0x3f, static_cast<size_t>(u.shard_numel) * 4);
    }
  }
  client::SummonOptions read;
  read.writeback = false;
  // The first Summon; before a kill (`commit`) a second one too, the steady state's.
  for (int i = 0; i < (commit ? 2 : 1); ++i) {
    const Clock::time_point s0 = Clock::now();
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s = (*c)->Summon("", "", read);
    if (!s.ok()) return s.status();
    const Clock::time_point s1 = Clock::now();
    (i == 0 ? t.first_summon_call_ms : t.warm_summon_call_ms) = MicrosSince(s0, s1) / 1000;
    if (i == 0) t.summon_ms = MicrosSince(t0, s1) / 1000;
    if (absl::Status e = (*s)->End(); !e.ok()) return e;
  }
  if (commit) {
    absl::StatusOr<uint64_t> g = (*c)->Commit("");
    if (!g.ok()) return g.status();
  }
  return t;
}

// Median and p99 of `n` Commit calls of a one-unit model of `numel` floats on a fresh daemon.
absl::StatusOr<std::pair<double, double>> CommitLatency(const std::string& binary,
                                                        const std::string& tag,
                                                        const std::vector<std::string>& flags,
                                                        int64_t numel, int n) {
  BenchDaemon d;
  if (absl::Status s = d.Start(binary, tag, flags); !s.ok()) return s;
  ClientOptions options;
  options.address = d.address();
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  if (!c.ok()) return c.status();
  if (absl::Status s = (*c)->Join("bench", 1, 0, "tok"); !s.ok()) return s;
  absl::StatusOr<client::RegisteredModule> m =
      (*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros);
  if (!m.ok()) return m.status();
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<uint64_t> g = (*c)->Commit("");
    if (!g.ok()) return g.status();
    us.push_back(MicrosSince(t0, Clock::now()));
  }
  return std::make_pair(Median(us), Percentile(us, 99));
}

int Main() {
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const std::string binary = absl::GetFlag(FLAGS_flatshardd);
  const int64_t numel = bytes / 4;
  const std::string tag = absl::StrCat("fsrestartbench", ::getpid());
  const std::filesystem::path state = std::filesystem::temp_directory_path() / (tag + "-state");
  std::filesystem::remove_all(state);
  const std::vector<std::string> flags = {"--state_dir=" + state.string(), "--log_level=warning"};
  std::printf(
      "restart benchmark: %lld bytes of shards (one rank, one unit), %d restarts, "
      "load %s, MemAvailable %lld MiB\n",
      static_cast<long long>(bytes), repeats, LoadAverage().c_str(),
      static_cast<long long>(MemAvailableBytes() >> 20));

  // Baseline 1: memcpy of the same bytes (pages touched first).
  std::vector<char> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes), 2);
  std::vector<double> copies;
  for (int i = 0; i < 3; ++i) {
    const Clock::time_point t0 = Clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    copies.push_back(MicrosSince(t0, Clock::now()) / 1000);
  }
  std::vector<char>().swap(a);
  std::vector<char>().swap(b);

  BenchDaemon d;
  // Baseline 2: a fresh daemon to a registered model of zeros, then its first summon; one
  // commit so that there is something to restart with.
  absl::StatusOr<Times> fresh = Attach(d, binary, tag, flags, numel, 0, /*commit=*/true);
  if (!fresh.ok()) {
    std::fprintf(stderr, "fresh start: %s\n%s\n", std::string(fresh.status().message()).c_str(),
                 d.LogTail().c_str());
    return 1;
  }
  std::vector<double> ready, reg, summon, summon_call;
  for (int i = 0; i < repeats; ++i) {
    d.Kill();
    absl::StatusOr<Times> t = Attach(d, binary, tag, flags, numel, 1, /*commit=*/false);
    if (!t.ok()) {
      std::fprintf(stderr, "restart %d: %s\n%s\n", i, std::string(t.status().message()).c_str(),
                   d.LogTail().c_str());
      return 1;
    }
    ready.push_back(t->ready_ms);
    reg.push_back(t->register_ms);
    summon.push_back(t->summon_ms);
    summon_call.push_back(t->first_summon_call_ms);
  }
  d.Stop();
  std::filesystem::remove_all(state);
  // What the records cost per commit: a 4 KiB model's Commit with and without --state_dir
  // (two record writes, each with an fsync of the file and of the directory, on the state
  // directory's disk: $TMPDIR here).
  auto without = CommitLatency(binary, tag + "c0", {"--log_level=warning"}, 1024, 200);
  auto with = CommitLatency(binary, tag + "c1", flags, 1024, 200);
  std::filesystem::remove_all(state);
  std::vector<std::string> nosync = flags;
  nosync.push_back("--state_fsync=false");
  auto with_nosync = CommitLatency(binary, tag + "c2", nosync, 1024, 200);
  std::filesystem::remove_all(state);
  std::printf("memcpy of the same bytes (this process):           %9.1f ms (median of 3)\n",
              Median(copies));
  std::printf("fresh daemon: exec -> socket / registered / summon: %9.1f / %.1f / %.1f ms\n",
              fresh->ready_ms, fresh->register_ms, fresh->summon_ms);
  std::printf(
      "restart (kill -9, same --state_dir): exec -> socket / re-registered / summon: "
      "%.1f / %.1f / %.1f ms (median of %d; min re-registered %.1f, max %.1f)\n",
      Median(ready), Median(reg), Median(summon), repeats, Percentile(reg, 0),
      Percentile(reg, 100));
  std::printf(
      "Summon call: before the kill (second, warm) %.1f ms; first after the restart %.1f ms "
      "(median): %.2fx\n",
      fresh->warm_summon_call_ms, Median(summon_call),
      Median(summon_call) / std::max(fresh->warm_summon_call_ms, 1e-3));
  if (without.ok() && with.ok() && with_nosync.ok()) {
    std::printf(
        "Commit of a 4 KiB model, 200 times: without --state_dir %.0f us median "
        "(p99 %.0f), with it %.0f us median (p99 %.0f) on %s, with it and "
        "--state_fsync=false %.0f us median (p99 %.0f)\n",
        without->first, without->second, with->first, with->second,
        std::filesystem::temp_directory_path().c_str(), with_nosync->first, with_nosync->second);
  } else {
    std::fprintf(stderr, "commit latency: %s / %s / %s\n",
                 std::string(without.status().message()).c_str(),
                 std::string(with.status().message()).c_str(),
                 std::string(with_nosync.status().message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flatshard::bench::Main();
}
