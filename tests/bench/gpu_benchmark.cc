// The GPU backend against its baselines, measured in one run on one GPU (issue "GPU backend"):
//   1. unshard: Summon(writeback=false) of a one-unit model of --bytes (world size 1,
//      flatshardd --gpus=0) until the bytes are ready on the trainer's stream
//      (cudaStreamSynchronize), then End, against a device-to-device cudaMemcpy of the same
//      bytes followed by cudaDeviceSynchronize (a D2D cudaMemcpy returns before the copy is
//      done, so without the synchronize the baseline measures only the launch);
//   2. first CUDA IPC open: cudaIpcOpenMemHandle of --ipc_bytes of device memory in another
//      process (this binary again), per GiB;
//   3. summon+end latency (p50, p99) of a small unit (--small_bytes), steady state, split into
//      Summon (until ready) and End, against an empty Ping RPC to the same daemon.
// Prints nccl-tests-like columns and the ratios. Exits 0 with a note where no GPU is usable.
//   build/tests/bench/flatshard_gpu_benchmark [--bytes 1073741824] [--iters 20]

#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/gpu/cuda_util.h"
#include "flatshard/client.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "bytes of the unshard benchmark's unit");
ABSL_FLAG(int64_t, small_bytes, 4096, "bytes of the latency benchmark's unit");
ABSL_FLAG(int64_t, ipc_bytes, int64_t{1} << 30, "device bytes opened through CUDA IPC");
ABSL_FLAG(int, iters, 20, "timed iterations of each measurement");
ABSL_FLAG(int, warmup, 3, "untimed iterations first");
ABSL_FLAG(std::string, gpu_collectives, "nccl", "flatshardd --gpu_collectives");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "daemon binary");
ABSL_FLAG(std::string, ipc_child, "", "internal: open this hex cudaIpcMemHandle_t and time it");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;
using client::SummonOptions;

#define CUDA_OR_DIE(call)                                             \
  do {                                                                \
    const cudaError_t e = (call);                                     \
    if (e != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e)); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

// The child of measurement 2: opens the handle, prints the seconds it took, closes it.
int IpcChild(const std::string& hex) {
  const std::string raw = absl::HexStringToBytes(hex);
  cudaIpcMemHandle_t handle;
  if (raw.size() != sizeof(handle)) return 2;
  std::memcpy(&handle, raw.data(), sizeof(handle));
  CUDA_OR_DIE(cudaSetDevice(0));
  CUDA_OR_DIE(cudaFree(nullptr));  // the context exists before the clock starts
  void* p = nullptr;
  const Clock::time_point t0 = Clock::now();
  CUDA_OR_DIE(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
  const Clock::time_point t1 = Clock::now();
  CUDA_OR_DIE(cudaIpcCloseMemHandle(p));
  std::printf("%.9f\n", MicrosSince(t0, t1) / 1e6);
  return 0;
}

std::unique_ptr<Client> Join(const std::string& address, const std::string& group, int64_t numel) {
  ClientOptions options;
  options.address = address;
  options.call_timeout = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  if (!c.ok() || !(*c)->Join(group, 1, 0, "bench").ok()) return nullptr;
  if (!(*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros).ok()) {
    return nullptr;
  }
  return *std::move(c);
}

// Microseconds of each timed Summon(writeback=false)+End of the whole model: the whole
// iteration, the Summon until its bytes are ready on the client's stream (the legacy default
// stream: ClientOptions::cuda_stream is null), and the End.
struct SummonSamples {
  std::vector<double> total, summon, end;
};
SummonSamples TimeSummons(Client& c, int warmup, int iters) {
  SummonOptions o;
  o.writeback = false;
  SummonSamples out;
  for (int i = 0; i < warmup + iters; ++i) {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> s = c.Summon("", "", o);
    if (!s.ok()) {
      std::fprintf(stderr, "summon: %s\n", s.status().ToString().c_str());
      std::exit(1);
    }
    CUDA_OR_DIE(cudaStreamSynchronize(nullptr));
    const Clock::time_point t1 = Clock::now();
    if (absl::Status e = (*s)->End(); !e.ok()) {
      std::fprintf(stderr, "end: %s\n", e.ToString().c_str());
      std::exit(1);
    }
    const Clock::time_point t2 = Clock::now();
    if (i < warmup) continue;
    out.total.push_back(MicrosSince(t0, t2));
    out.summon.push_back(MicrosSince(t0, t1));
    out.end.push_back(MicrosSince(t1, t2));
  }
  return out;
}

// Microseconds of each of `iters` empty Ping RPCs (after `warmup`), on a channel with the
// client library's arguments.
std::vector<double> TimePings(const std::string& address, int warmup, int iters) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  std::unique_ptr<v1::ShardService::Stub> stub = v1::ShardService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  std::vector<double> us;
  for (int i = 0; i < warmup + iters; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PingRequest req;
    v1::PingResponse resp;
    const Clock::time_point t0 = Clock::now();
    if (grpc::Status st = stub->Ping(&ctx, req, &resp); !st.ok()) {
      std::fprintf(stderr, "Ping: %s\n", st.error_message().c_str());
      std::exit(1);
    }
    if (i >= warmup) us.push_back(MicrosSince(t0, Clock::now()));
  }
  return us;
}

int Run() {
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok()) {
    std::printf("# no GPU: %s; nothing measured\n", std::string(gpus.status().message()).c_str());
    return 0;
  }
  const int iters = absl::GetFlag(FLAGS_iters), warmup = absl::GetFlag(FLAGS_warmup);
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  std::printf("# GPU 0: %s; load %s\n", (*gpus)[0].name.c_str(), LoadAverage().c_str());

  // 1. Unshard vs cudaMemcpy D2D.
  CUDA_OR_DIE(cudaSetDevice(0));
  void *a = nullptr, *b = nullptr;
  CUDA_OR_DIE(cudaMalloc(&a, bytes));
  CUDA_OR_DIE(cudaMalloc(&b, bytes));
  std::vector<double> copy_us;
  for (int i = 0; i < warmup + iters; ++i) {
    const Clock::time_point t0 = Clock::now();
    CUDA_OR_DIE(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    CUDA_OR_DIE(cudaDeviceSynchronize());
    if (i >= warmup) copy_us.push_back(MicrosSince(t0, Clock::now()));
  }
  CUDA_OR_DIE(cudaFree(a));
  CUDA_OR_DIE(cudaFree(b));
  BenchDaemon daemon;
  absl::Status started =
      daemon.Start(absl::GetFlag(FLAGS_flatshardd), absl::StrCat("fsgpubench", ::getpid()),
                   {"--gpus=0", "--gpu_collectives=" + absl::GetFlag(FLAGS_gpu_collectives)});
  if (!started.ok()) {
    std::fprintf(stderr, "flatshardd: %s\n", started.ToString().c_str());
    return 1;
  }
  std::unique_ptr<Client> big = Join(daemon.address(), "big", bytes / 4);
  if (big == nullptr) {
    std::fprintf(stderr, "join/register failed; see %s\n", daemon.tag().c_str());
    return 1;
  }
  const SummonSamples big_us = TimeSummons(*big, warmup, iters);
  const double summon_s = Median(big_us.summon) / 1e6, total_s = Median(big_us.total) / 1e6;
  const double copy_s = Median(copy_us) / 1e6;
  std::printf("%-30s %14s %12s %10s\n", "# op (median)", "size(B)", "time(us)", "algbw(GB/s)");
  std::printf("%-30s %14lld %12.1f %10.2f\n", "cudaMemcpy D2D + sync",
              static_cast<long long>(bytes), copy_s * 1e6, bytes / copy_s / 1e9);
  std::printf("%-30s %14lld %12.1f %10.2f\n", "unshard (summon to ready, w=1)",
              static_cast<long long>(bytes), summon_s * 1e6, bytes / summon_s / 1e9);
  std::printf("%-30s %14lld %12.1f %10.2f\n", "unshard + end", static_cast<long long>(bytes),
              total_s * 1e6, bytes / total_s / 1e9);
  std::printf("unshard / cudaMemcpy D2D = %.2f (with end: %.2f)\n", summon_s / copy_s,
              total_s / copy_s);
  big.reset();

  // 2. First CUDA IPC open, in another process.
  const int64_t ipc_bytes = absl::GetFlag(FLAGS_ipc_bytes);
  void* shared = nullptr;
  CUDA_OR_DIE(cudaMalloc(&shared, ipc_bytes));
  cudaIpcMemHandle_t handle;
  CUDA_OR_DIE(cudaIpcGetMemHandle(&handle, shared));
  const std::string hex = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  std::vector<double> open_s;
  for (int i = 0; i < std::max(3, iters / 4); ++i) {
    const std::string cmd = absl::StrCat("/proc/", ::getpid(), "/exe --ipc_child=", hex);
    FILE* child = ::popen(cmd.c_str(), "r");
    double s = -1;
    if (child == nullptr || std::fscanf(child, "%lf", &s) != 1 || ::pclose(child) != 0 || s < 0) {
      std::fprintf(stderr, "IPC child failed\n");
      return 1;
    }
    open_s.push_back(s);
  }
  CUDA_OR_DIE(cudaFree(shared));
  std::printf("first cudaIpcOpenMemHandle: %.1f us for %lld bytes = %.1f us/GiB (median of %zu)\n",
              Median(open_s) * 1e6, static_cast<long long>(ipc_bytes),
              Median(open_s) * 1e6 / (static_cast<double>(ipc_bytes) / (1 << 30)), open_s.size());

  // 3. Small unit: summon+end latency vs an empty Ping.
  std::unique_ptr<Client> small =
      Join(daemon.address(), "small", absl::GetFlag(FLAGS_small_bytes) / 4);
  if (small == nullptr) return 1;
  const int64_t opens_before = small->ipc_open_calls();
  const SummonSamples small_us = TimeSummons(*small, warmup * 10, iters * 10);
  const int64_t opens_after = small->ipc_open_calls();
  const std::vector<double> ping_us = TimePings(daemon.address(), warmup * 10, iters * 20);
  const double ping50 = Percentile(ping_us, 50), ping99 = Percentile(ping_us, 99);
  std::printf("empty Ping RPC: p50 %.1f us, p99 %.1f us\n", ping50, ping99);
  std::printf(
      "small unit (%lld B) summon+end: p50 %.1f us (%.2fx two Pings), p99 %.1f us "
      "(%.2fx)\n",
      static_cast<long long>(absl::GetFlag(FLAGS_small_bytes)), Percentile(small_us.total, 50),
      Percentile(small_us.total, 50) / (2 * ping50), Percentile(small_us.total, 99),
      Percentile(small_us.total, 99) / (2 * ping99));
  std::printf("  summon to ready: p50 %.1f us, p99 %.1f us; end: p50 %.1f us, p99 %.1f us\n",
              Percentile(small_us.summon, 50), Percentile(small_us.summon, 99),
              Percentile(small_us.end, 50), Percentile(small_us.end, 99));
  std::printf("IPC opens during the %d timed summons: %lld (steady state: 0)\n",
              warmup * 10 + iters * 10, static_cast<long long>(opens_after - opens_before));
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const std::string hex = absl::GetFlag(FLAGS_ipc_child); !hex.empty()) {
    return flatshard::bench::IpcChild(hex);
  }
  return flatshard::bench::Run();
}
