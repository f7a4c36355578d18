// The cost of GPU daemons' host copy at each commit (README "Restarts": GPU daemons), on
// SIMULATED GPUs (flatshardd --simulate_gpus=1: device memory is host shared memory, so the
// device-to-host copy is a memcpy; a real GPU's PCIe copy is not measured here). One rank
// (world size 1) holding --bytes of shards, with a state directory; the same run measures a
// daemon with --gpu_host_copies=false (the baseline) and one with the copies on:
//   1. Commit latency (the trainer's call) with the previous copy recorded first: on/off ratio;
//      and, with the copies on, from the Commit's answer to the log line saying the copy of that
//      generation is recorded (fsync'd);
//   2. back-to-back steps (write every element, Commit) with no wait: the step time on/off
//      ratio (a Commit waits for a copy still running, so a step shorter than the copy pays it).
//
//   build/tests/bench/flatshard_gpu_host_copy_benchmark [--bytes 268435456] [--iters 10]

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"
#include "tests/testing/simulated_gpu.h"

ABSL_FLAG(int64_t, bytes, int64_t{256} << 20, "shard bytes of the one rank (float32 x 4)");
ABSL_FLAG(int, iters, 10, "commits measured per phase (medians reported)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;

struct Figures {
  double commit_ms = 0;    // phase 1: Commit call, median
  double recorded_ms = 0;  // phase 1: Commit answered -> copy recorded, median (copies on)
  double step_ms = 0;      // phase 2: write + Commit back to back, median
};

absl::Status WriteAll(Client& c, float value) {
  absl::StatusOr<client::ShardViews> v = c.GetShardViews("");
  if (!v.ok()) return v.status();
  for (const client::UnitShardView& u : *v) {
    float* data = static_cast<float*>(u.data);
    for (int64_t i = 0; i < u.shard_numel; ++i) data[i] = value;
  }
  return absl::OkStatus();
}

// Waits (at most 120 s) for the copy of `generation` to be logged as recorded.
absl::Status WaitRecorded(BenchDaemon& d, uint64_t generation) {
  const std::string text = absl::StrCat("host copy of generation ", generation, " recorded");
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (d.Log().find(text) == std::string::npos) {
    if (absl::Now() > until) return absl::DeadlineExceededError(absl::StrCat("no '", text, "'"));
    absl::SleepFor(absl::Microseconds(200));
  }
  return absl::OkStatus();
}

absl::StatusOr<Figures> Run(bool copies, int64_t numel, int iters) {
  const std::string tag = absl::StrCat("fshcb", getpid(), copies ? "on" : "off");
  const std::filesystem::path state = std::filesystem::temp_directory_path() / (tag + ".state");
  BenchDaemon d;
  absl::Status started = d.Start(absl::GetFlag(FLAGS_flatshardd), tag,
                                 {"--state_dir=" + state.string(), "--simulate_gpus=1",
                                  absl::StrCat("--gpu_host_copies=", copies ? "true" : "false")});
  if (!started.ok()) return started;
  ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(120);
  options.join_timeout = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<Client>> c =
      client::internal::ConnectWithGpuApis(options, testing::SimulatedGpuApis());
  if (!c.ok()) return c.status();
  if (absl::Status s = (*c)->Join("bench", 1, 0, "tok"); !s.ok()) return s;
  absl::StatusOr<client::RegisteredModule> m =
      (*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros);
  if (!m.ok()) return m.status();
  Figures f;
  std::vector<double> commit, recorded, step;
  uint64_t g = 0;
  for (int i = 0; i < iters + 1; ++i) {  // the first commit (allocations) is not counted
    if (absl::Status s = WriteAll(**c, static_cast<float>(i)); !s.ok()) return s;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<uint64_t> done = (*c)->Commit("");
    if (!done.ok()) return done.status();
    const Clock::time_point t1 = Clock::now();
    g = *done;
    if (copies) {
      if (absl::Status s = WaitRecorded(d, g); !s.ok()) return s;
    }
    if (i == 0) continue;
    commit.push_back(MicrosSince(t0, t1) / 1000);
    if (copies) recorded.push_back(MicrosSince(t1, Clock::now()) / 1000);
  }
  for (int i = 0; i < iters; ++i) {
    const Clock::time_point t0 = Clock::now();
    if (absl::Status s = WriteAll(**c, static_cast<float>(i)); !s.ok()) return s;
    absl::StatusOr<uint64_t> done = (*c)->Commit("");
    if (!done.ok()) return done.status();
    step.push_back(MicrosSince(t0, Clock::now()) / 1000);
  }
  f.commit_ms = Median(commit);
  f.recorded_ms = copies ? Median(recorded) : 0;
  f.step_ms = Median(step);
  c->reset();
  d.Stop();
  std::error_code ignored;
  std::filesystem::remove_all(state, ignored);
  return f;
}

int Main() {
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  const int64_t numel = bytes / 4;
  absl::StatusOr<Figures> off = Run(false, numel, iters);
  if (!off.ok()) {
    std::fprintf(stderr, "baseline (--gpu_host_copies=false): %s\n",
                 std::string(off.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<Figures> on = Run(true, numel, iters);
  if (!on.ok()) {
    std::fprintf(stderr, "--gpu_host_copies: %s\n", std::string(on.status().message()).c_str());
    return 1;
  }
  std::printf("SIMULATED GPU (device memory is host memory): %lld bytes, 1 rank, %d commits\n",
              static_cast<long long>(bytes), iters);
  std::printf("commit latency, copy recorded first: off %.2f ms, on %.2f ms (ratio on/off %.2f)\n",
              off->commit_ms, on->commit_ms, on->commit_ms / off->commit_ms);
  std::printf("commit answered -> host copy recorded: %.2f ms\n", on->recorded_ms);
  std::printf("back-to-back step (write + commit): off %.2f ms, on %.2f ms (ratio on/off %.2f)\n",
              off->step_ms, on->step_ms, on->step_ms / off->step_ms);
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flatshard::bench::Main();
}
