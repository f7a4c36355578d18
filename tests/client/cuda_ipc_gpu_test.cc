// Needs a GPU (label gpu): the real CUDA IPC opener and event code across two processes. The
// parent allocates a buffer and records an interprocess event after a kernel-free copy into
// it; the child (this binary again, exec'd) opens both through SegmentCache and StreamEvents
// and copies the buffer out on a stream that waits for the event. The parent's copy is held
// back until the child has enqueued its copy, so without the event the child reads zeros.
// Skips where ListGpus() fails (no GPU, no driver, built without CUDA).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cuda_events.h"
#include "client/segment_cache.h"
#include "common/config.h"
#include "common/gpu/cuda_util.h"
#include "gtest/gtest.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

extern char** environ;

namespace flatshard::client::internal {
namespace {

#if FS_HAVE_CUDA

constexpr size_t kBytes = 8 << 20;
constexpr uint64_t kOffset = 4096;  // the child maps [kOffset, kBytes) of the "slab"

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i * 7 + 3); }

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

// Blocks the parent's stream until the child says it has enqueued its copy (or 30 s pass).
void CUDART_CB WaitForChild(void* fd) {
  pollfd p{static_cast<int>(reinterpret_cast<intptr_t>(fd)), POLLIN, 0};
  ::poll(&p, 1, /*timeout_ms=*/30000);
}

TEST(CudaIpcGpuTest, ChildOpensTheBufferOnceAndItsStreamWaitsForTheEvent) {
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok()) GTEST_SKIP() << gpus.status();
  const gpu::GpuDevice& g = gpus->front();
  ASSERT_CUDA(cudaSetDevice(g.ordinal));
  void* buffer = nullptr;
  ASSERT_CUDA(cudaMalloc(&buffer, kBytes));
  ASSERT_CUDA(cudaMemset(buffer, 0, kBytes));
  ASSERT_CUDA(cudaDeviceSynchronize());
  uint8_t* pinned = nullptr;
  ASSERT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&pinned), kBytes));
  for (size_t i = 0; i < kBytes; ++i) pinned[i] = Pattern(i);
  cudaIpcMemHandle_t mem;
  ASSERT_CUDA(cudaIpcGetMemHandle(&mem, buffer));

  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaLaunchHostFunc(stream, WaitForChild,
                                 reinterpret_cast<void*>(static_cast<intptr_t>(pipe_fds[0]))));
  ASSERT_CUDA(cudaMemcpyAsync(buffer, pinned, kBytes, cudaMemcpyHostToDevice, stream));
  StreamEvents events;  // the real CUDA event API
  absl::StatusOr<IpcEvent> written = events.RecordWritten(g.ordinal, stream);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->device_uuid, g.uuid);

  const std::string self = "/proc/self/exe";
  std::vector<std::string> env = {
      absl::StrCat("FS_IPC_CHILD_MEM=", absl::BytesToHexString(absl::string_view(
                                            reinterpret_cast<char*>(&mem), sizeof(mem)))),
      absl::StrCat("FS_IPC_CHILD_EVENT=", absl::BytesToHexString(written->ipc_handle)),
      absl::StrCat("FS_IPC_CHILD_EVENT_ID=", written->id),
      absl::StrCat("FS_IPC_CHILD_UUID=", g.uuid), absl::StrCat("FS_IPC_CHILD_FD=", pipe_fds[1])};
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string arg0 = self, arg1 = "--gtest_filter=CudaIpcChild.*";
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t child = -1;
  ASSERT_EQ(::posix_spawn(&child, self.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  ::close(pipe_fds[1]);

  int status = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  pid_t done = 0;
  while ((done = ::waitpid(child, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    ADD_FAILURE() << "the child did not finish within 60 s";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ASSERT_CUDA(cudaStreamSynchronize(stream));  // the gate opened when the child wrote or exited
  ::close(pipe_fds[0]);
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
  cudaFree(buffer);
}

// The child half; skipped unless started by the test above.
TEST(CudaIpcChild, OpensAndCopiesAfterTheParentsEvent) {
  const char* mem_hex = std::getenv("FS_IPC_CHILD_MEM");
  if (mem_hex == nullptr) GTEST_SKIP() << "runs only as CudaIpcGpuTest's child process";
  const std::string uuid = std::getenv("FS_IPC_CHILD_UUID");
  int fd = -1;
  uint64_t event_id = 0;
  ASSERT_TRUE(absl::SimpleAtoi(std::getenv("FS_IPC_CHILD_FD"), &fd));
  ASSERT_TRUE(absl::SimpleAtoi(std::getenv("FS_IPC_CHILD_EVENT_ID"), &event_id));

  SegmentCache cache;  // the real opener
  SegmentRange range;
  range.segment = "slab-under-test";
  range.segment_bytes = kBytes;
  range.offset = kOffset;
  range.bytes = kBytes - kOffset;
  range.cuda = true;
  range.cuda_ipc_handle = absl::HexStringToBytes(mem_hex);
  range.device_uuid = uuid;
  absl::StatusOr<MappedRange> writable = cache.Map(range, /*writable=*/true);
  ASSERT_TRUE(writable.ok()) << writable.status();
  absl::StatusOr<MappedRange> read_only = cache.Map(range, /*writable=*/false);
  ASSERT_TRUE(read_only.ok()) << read_only.status();
  EXPECT_EQ(cache.ipc_open_calls(), 1);
  EXPECT_EQ(writable->data, read_only->data);
  absl::StatusOr<int> device = gpu::DeviceForUuid(uuid);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(writable->device, *device);

  ASSERT_CUDA(cudaSetDevice(*device));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  StreamEvents events;
  IpcEvent ready{event_id, absl::HexStringToBytes(std::getenv("FS_IPC_CHILD_EVENT")), uuid};
  ASSERT_TRUE(events.WaitReady(ready, stream).ok());
  std::vector<uint8_t> out(range.bytes);
  ASSERT_CUDA(
      cudaMemcpyAsync(out.data(), writable->data, out.size(), cudaMemcpyDeviceToHost, stream));
  ASSERT_EQ(::write(fd, "x", 1), 1);  // now the parent's copy may run
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  size_t bad = 0;
  for (size_t i = 0; i < out.size(); ++i) bad += out[i] != Pattern(kOffset + i);
  EXPECT_EQ(bad, 0u) << "bytes read before the parent's copy landed";
  cudaStreamDestroy(stream);
}

#else  // !FS_HAVE_CUDA

TEST(CudaIpcGpuTest, ChildOpensTheBufferOnceAndItsStreamWaitsForTheEvent) {
  GTEST_SKIP() << gpu::ListGpus().status();
}

#endif  // FS_HAVE_CUDA

}  // namespace
}  // namespace flatshard::client::internal
