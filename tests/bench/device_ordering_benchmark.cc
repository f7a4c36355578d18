// Summon latency with device-side ordering (flatshardd --gpu_device_ordering=true) against the
// host-wait path (false, the baseline) in the same run, on SIMULATED GPUs (--simulate_gpus=1:
// device memory is host shared memory, streams are worker threads, copies memcpy). One rank
// (world size 1: the summon is one device copy per unit) holding --bytes of shards; the trainer's
// cuda_stream is a simulated stream, so the client's wait on `ready` is enqueued, not waited.
//   1. Summon call latency (median): device-ordered, the daemon answers once its copy is
//      enqueued; host-wait, once the copy ran on its device worker.
//   2. Summon call + the trainer's stream synchronized (the views readable), median.
// This shows the HOST-side cost only (thread hops, waits before the answer): a real GPU's
// stream wait on an interprocess event and its D2D copy are not measured here.
//
//   build/tests/bench/flatshard_device_ordering_benchmark [--bytes 16777216] [--iters 50]

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/gpu/simulated_stream.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"
#include "tests/testing/simulated_gpu.h"

ABSL_FLAG(int64_t, bytes, int64_t{16} << 20, "shard bytes of the one rank (float32 x 4)");
ABSL_FLAG(int, iters, 50, "summons measured per mode (medians reported)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;

struct Figures {
  double summon_us = 0;    // Summon call, median
  double readable_us = 0;  // Summon call + trainer stream synchronized, median
};

absl::StatusOr<Figures> Run(bool device_ordering, int64_t numel, int iters) {
  const std::string tag = absl::StrCat("fsdob", getpid(), device_ordering ? "dev" : "host");
  BenchDaemon d;
  absl::Status started =
      d.Start(absl::GetFlag(FLAGS_flatshardd), tag,
              {"--simulate_gpus=1",
               absl::StrCat("--gpu_device_ordering=", device_ordering ? "true" : "false")});
  if (!started.ok()) return started;
  gpu::SimulatedStream stream("trainer");
  ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(120);
  options.join_timeout = absl::Seconds(120);
  options.cuda_stream = &stream;
  absl::StatusOr<std::unique_ptr<Client>> c =
      client::internal::ConnectWithGpuApis(options, testing::SimulatedGpuApis());
  if (!c.ok()) return c.status();
  if (absl::Status s = (*c)->Join("bench", 1, 0, "tok"); !s.ok()) return s;
  absl::StatusOr<client::RegisteredModule> m =
      (*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros);
  if (!m.ok()) return m.status();
  client::SummonOptions read_only;
  read_only.writeback = false;
  std::vector<double> summon, readable;
  for (int i = 0; i < iters + 1; ++i) {  // the first summon (allocations) is not counted
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s = (*c)->Summon("", "", read_only);
    if (!s.ok()) return s.status();
    const Clock::time_point t1 = Clock::now();
    if (absl::Status synced = stream.Synchronize(absl::Minutes(1)); !synced.ok()) return synced;
    const Clock::time_point t2 = Clock::now();
    if (absl::Status ended = (*s)->End(); !ended.ok()) return ended;
    if (i == 0) continue;
    summon.push_back(MicrosSince(t0, t1));
    readable.push_back(MicrosSince(t0, t2));
  }
  Figures f;
  f.summon_us = Median(summon);
  f.readable_us = Median(readable);
  c->reset();
  d.Stop();
  return f;
}

int Main() {
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  absl::StatusOr<Figures> host = Run(false, bytes / 4, iters);
  if (!host.ok()) {
    std::fprintf(stderr, "baseline (--gpu_device_ordering=false): %s\n",
                 std::string(host.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<Figures> dev = Run(true, bytes / 4, iters);
  if (!dev.ok()) {
    std::fprintf(stderr, "--gpu_device_ordering=true: %s\n",
                 std::string(dev.status().message()).c_str());
    return 1;
  }
  std::printf("SIMULATED GPU (host-side cost only): %lld bytes, world 1, %d summons; load %s\n",
              static_cast<long long>(bytes), iters, LoadAverage().c_str());
  std::printf("summon call: host-wait %.1f us, device-ordered %.1f us (ratio device/host %.2f)\n",
              host->summon_us, dev->summon_us, dev->summon_us / host->summon_us);
  std::printf("summon + views readable: host-wait %.1f us, device-ordered %.1f us (ratio %.2f)\n",
              host->readable_us, dev->readable_us, dev->readable_us / host->readable_us);
  PrintFigure("latency.simgpu.summon.device_over_host", dev->summon_us / host->summon_us, "ratio");
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flatshard::bench::Main();
}
