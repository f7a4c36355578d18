// BackendRegistry and RegisterBuiltinBackends.

#include "server/collective/backend_registry.h"

#include "common/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::collective {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BackendRegistryTest, BuiltinsIncludeInproc) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  EXPECT_TRUE(registry.Has("inproc"));
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b = registry.Create("inproc");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "inproc");
  EXPECT_TRUE(absl::IsAlreadyExists(RegisterBuiltinBackends(registry)));
}

TEST(BackendRegistryTest, UnknownNamesListWhatExists) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  absl::Status s = registry.Create("verbs").status();
  EXPECT_TRUE(absl::IsNotFound(s));
  std::string known = "inproc";
  if (FS_HAVE_NCCL) known += ", nccl";
  if (FS_HAVE_UCX) known += ", ucx";
  EXPECT_EQ(s.message(), "unknown collective backend 'verbs' (registered: " + known + ")");
}

TEST(BackendRegistryTest, InprocParamsAreParsedAndChecked) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  EXPECT_TRUE(registry.Create("inproc", {{"copy_threads", "2"}, {"piece_bytes", "65536"}}).ok());
  absl::Status bad = registry.Create("inproc", {{"copy_threads", "many"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("copy_threads must be an integer"));
  absl::Status unknown = registry.Create("inproc", {{"threads", "2"}}).status();
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("unknown parameter 'threads'"));
}

#if FS_HAVE_UCX
TEST(BackendRegistryTest, UcxIsRegisteredAndItsParamsAreChecked) {
  BackendRegistry registry;
  ASSERT_TRUE(RegisterBuiltinBackends(registry).ok());
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> b =
      registry.Create("ucx", {{"poll_before_sleep_us", "50"}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "ucx");
  EXPECT_FALSE((*b)->LocalAddress().empty());
  absl::Status bad = registry.Create("ucx", {{"drain_for_ms", "-1"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  absl::Status unknown = registry.Create("ucx", {{"rails", "2"}}).status();
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("unknown parameter 'rails'"));
  absl::Status bad_tls = registry.Create("ucx", {{"tls", "no-such-transport"}}).status();
  EXPECT_TRUE(absl::IsUnavailable(bad_tls)) << bad_tls;
  EXPECT_TRUE(registry.Create("ucx", {{"hierarchical", "off"}}).ok());
  absl::Status bad_hier = registry.Create("ucx", {{"hierarchical", "maybe"}}).status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad_hier)) << bad_hier;
  EXPECT_THAT(std::string(bad_hier.message()), HasSubstr("hierarchical must be 'on' or 'off'"));
}
#endif

TEST(BackendRegistryTest, RegisterChecksNamesAndFactories) {
  BackendRegistry registry;
  EXPECT_TRUE(absl::IsInvalidArgument(registry.Register("", nullptr)));
  ASSERT_TRUE(
      registry
          .Register("fake",
                    [](const BackendParams&) -> absl::StatusOr<std::unique_ptr<CollectiveBackend>> {
                      return absl::UnavailableError("no fake hardware");
                    })
          .ok());
  EXPECT_TRUE(absl::IsUnavailable(registry.Create("fake").status()));
  EXPECT_THAT(registry.Names(), ElementsAre("fake"));
}

}  // namespace
}  // namespace flatshard::collective
