// flatshardd's GPU flags refused at startup with a message naming the flag (runs everywhere:
// on a machine without a GPU, --gpus itself is the refusal).

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/gpu/cuda_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

struct Outcome {
  int exit_code = 0;
  std::string stderr_text;
};

// Runs flatshardd with `flags` on a private socket; it must exit by itself (a refusal).
Outcome RunDaemon(const std::string& flags) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("fsgpustart", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string err = (dir / "stderr").string();
  const std::string cmd = absl::StrCat(
      "timeout 20 ", FS_BINARY_DIR, "/server/flatshardd --socket=", (dir / "d.sock").string(),
      " --ephemeral --segment_prefix=fsgpustart", ::getpid(), " ", flags, " 2>", err);
  const int status = std::system(cmd.c_str());
  Outcome out{WIFEXITED(status) ? WEXITSTATUS(status) : 128, testing::ReadFile(err)};
  std::filesystem::remove_all(dir);
  return out;
}

TEST(GpuStartupTest, GpusWithoutAUsableGpuIsRefusedSayingWhy) {
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (gpus.ok()) GTEST_SKIP() << "this machine has a GPU";
  const Outcome out = RunDaemon("--gpus=all");
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text, HasSubstr("--gpus=all: no usable GPU"));
}

TEST(GpuStartupTest, BadGpuFlagsAreRefusedNamingTheFlag) {
  Outcome out = RunDaemon("--gpus=0 --gpu_collectives=sometimes");
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text, HasSubstr("--gpu_collectives must be auto, nccl or host"));
  out = RunDaemon("--gpus=0 --gpu_memory_limit_mib=-1");
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text, HasSubstr("--gpu_memory_limit_mib must be >= 0"));
}

TEST(GpuStartupTest, GpusOutOfRangeIsRefusedWhereThereAreGpus) {
  absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
  if (!gpus.ok()) GTEST_SKIP() << "no GPU: " << gpus.status().message();
  const Outcome out = RunDaemon(absl::StrCat("--gpus=", gpus->size()));
  EXPECT_NE(out.exit_code, 0);
  EXPECT_THAT(out.stderr_text, HasSubstr("is not a GPU of this machine"));
}

}  // namespace
}  // namespace flatshard
