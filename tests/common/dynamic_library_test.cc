// DynamicLibrary (common/dynamic_library.h): the search order, and the errors that name the
// library, every place tried and a missing symbol. libz.so.1 stands in for libcudart: it is a
// Debian library every build of flatshard links through gRPC.
#include "common/dynamic_library.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

constexpr char kEnv[] = "FLATSHARD_TEST_DYNAMIC_LIBRARY";

class DynamicLibraryTest : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv(kEnv); }
};

TEST_F(DynamicLibraryTest, FindsTheSonameThroughTheLoaderAndResolvesSymbols) {
  auto lib = DynamicLibrary::Open(
      {.name = "zlib", .soname = "libz.so.1", .env_var = kEnv, .fallback_dirs = {}});
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_THAT((*lib)->path(), MatchesRegex("/.*/libz\\.so\\.1"));
  auto address = (*lib)->Symbol("zlibVersion");
  ASSERT_TRUE(address.ok()) << address.status();
  const auto zlib_version = reinterpret_cast<const char* (*)()>(*address);
  EXPECT_EQ(std::string(zlib_version()).substr(0, 1), "1");
}

TEST_F(DynamicLibraryTest, TheEnvironmentVariableIsTriedFirst) {
  // The soname does not exist; the variable names the real file.
  setenv(kEnv, "libz.so.1", 1);
  auto lib = DynamicLibrary::Open(
      {.name = "zlib", .soname = "libnosuch.so.7", .env_var = kEnv, .fallback_dirs = {}});
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_THAT((*lib)->path(), MatchesRegex("/.*/libz\\.so\\.1"));
}

TEST_F(DynamicLibraryTest, AMissingLibraryNamesEveryPlaceTriedWithTheLoadersReason) {
  setenv(kEnv, "/nonexistent/libnosuch.so.7", 1);
  auto lib = DynamicLibrary::Open({.name = "the test library",
                                   .soname = "libnosuch.so.7",
                                   .env_var = kEnv,
                                   .fallback_dirs = {"/nonexistent/a", "/nonexistent/b"}});
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string m(lib.status().message());
  EXPECT_THAT(m, HasSubstr("the test library (libnosuch.so.7) not found; tried: "));
  EXPECT_THAT(m, HasSubstr("FLATSHARD_TEST_DYNAMIC_LIBRARY=/nonexistent/libnosuch.so.7: "));
  EXPECT_THAT(m, HasSubstr("the dynamic loader's search path"));
  EXPECT_THAT(
      m, HasSubstr("/nonexistent/b: /nonexistent/b/libnosuch.so.7: cannot open shared object"));
  EXPECT_THAT(m, HasSubstr("Set FLATSHARD_TEST_DYNAMIC_LIBRARY"));
  // In the search order.
  EXPECT_LT(m.find("FLATSHARD_TEST_DYNAMIC_LIBRARY="), m.find("dynamic loader"));
  EXPECT_LT(m.find("dynamic loader"), m.find("/nonexistent/a:"));
  EXPECT_LT(m.find("/nonexistent/a:"), m.find("/nonexistent/b:"));
}

TEST_F(DynamicLibraryTest, AMissingSymbolNamesItAndTheFile) {
  auto lib = DynamicLibrary::Open(
      {.name = "zlib", .soname = "libz.so.1", .env_var = "", .fallback_dirs = {}});
  ASSERT_TRUE(lib.ok()) << lib.status();
  auto address = (*lib)->Symbol("cudaMalloc");
  ASSERT_FALSE(address.ok());
  EXPECT_EQ(address.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(address.status().message()),
              MatchesRegex("zlib at /.*/libz\\.so\\.1 lacks the symbol cudaMalloc .*"));
}

TEST(CudaToolkitLibraryDirsTest, NamesTheToolkitsLibraryDirectories) {
  const auto dirs = CudaToolkitLibraryDirs();
  ASSERT_FALSE(dirs.empty());
  EXPECT_EQ(dirs[0], "/usr/local/cuda/lib64");
}

}  // namespace
}  // namespace flatshard
