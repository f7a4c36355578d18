// tests/testing/emulated_links.h: namespaces joined over the bridge (a TCP connection from one
// node to the other's address), shaped by tbf at the asked rate, nothing left in this
// namespace, everything gone after destruction, and namespaces of a dead owner removed by
// the next Create. Skips, naming why, where namespaces cannot be made.

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/emulated_links.h"

namespace flatshard::testing {
namespace {

using ::testing::HasSubstr;

bool NamespaceExists(const std::string& name) {
  return std::filesystem::exists("/var/run/netns/" + name);
}

std::unique_ptr<EmulatedLinks> CreateOrSkip(const LinkOptions& o, std::string* skip) {
  absl::StatusOr<std::unique_ptr<EmulatedLinks>> links = EmulatedLinks::Create(o);
  if (!links.ok()) {
    *skip = std::string(links.status().message());
    return nullptr;
  }
  return *std::move(links);
}

TEST(EmulatedLinksTest, NodesReachEachOtherOverTheShapedLinkAndTeardownRemovesAll) {
  LinkOptions o;
  o.nodes = 3;
  o.rate = "2gbit";
  std::string skip;
  std::unique_ptr<EmulatedLinks> links = CreateOrSkip(o, &skip);
  if (links == nullptr) GTEST_SKIP() << "no emulated nodes here: " << skip;
  EXPECT_EQ(links->rate_bits_per_s(), 2e9);
  const std::string n0 = links->ns(0), n2 = links->ns(2);
  ASSERT_TRUE(NamespaceExists(n0));
  absl::StatusOr<std::string> tc =
      RunCommand({"ip", "netns", "exec", n0, "tc", "qdisc", "show", "dev", "fsl0"});
  ASSERT_TRUE(tc.ok()) << tc.status();
  EXPECT_THAT(*tc, HasSubstr("tbf"));
  EXPECT_THAT(*tc, HasSubstr("rate 2Gbit"));
  absl::StatusOr<std::string> route =
      RunCommand({"ip", "netns", "exec", n0, "ip", "route", "get", EmulatedLinks::address(2)});
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_THAT(*route, HasSubstr("dev fsl0"));
  // A connection from node 2 to node 0's port 1 (nothing listens: refused, which still
  // resolves node 0 over the bridge).
  absl::StatusOr<std::string> talk = RunCommand(
      {"ip", "netns", "exec", n2, "bash", "-c",
       absl::StrCat("exec 3<>/dev/tcp/", EmulatedLinks::address(0), "/1 2>/dev/null; echo $?")});
  ASSERT_TRUE(talk.ok()) << talk.status();
  absl::StatusOr<std::string> arp =
      RunCommand({"ip", "netns", "exec", n2, "ip", "neigh", "show", EmulatedLinks::address(0)});
  ASSERT_TRUE(arp.ok()) << arp.status();
  EXPECT_THAT(*arp,
              ::testing::AnyOf(HasSubstr("REACHABLE"), HasSubstr("STALE"), HasSubstr("DELAY")))
      << "node 2 never resolved node 0 over the bridge";
  // This namespace has no address of theirs.
  absl::StatusOr<std::string> own = RunCommand({"ip", "-o", "addr"});
  ASSERT_TRUE(own.ok());
  EXPECT_THAT(*own, ::testing::Not(HasSubstr("10.77.0.")));
  links.reset();
  EXPECT_FALSE(NamespaceExists(n0));
  EXPECT_FALSE(NamespaceExists(n2));
}

TEST(EmulatedLinksTest, NamespacesOfADeadOwnerAreRemovedByTheNextCreate) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  waitpid(child, nullptr, 0);  // `child` is a pid no process has now
  const std::string stale = absl::StrCat("fsl", child, "x0n0");
  if (!RunCommand({"ip", "netns", "add", stale}).ok()) {
    GTEST_SKIP() << "cannot create network namespaces here";
  }
  LinkOptions o;
  o.nodes = 1;
  o.rate = "";
  o.delay = "";
  std::string skip;
  std::unique_ptr<EmulatedLinks> links = CreateOrSkip(o, &skip);
  EXPECT_FALSE(NamespaceExists(stale)) << "leftover " << stale << " was kept";
  (void)RunCommand({"ip", "netns", "del", stale});
  if (links == nullptr) GTEST_SKIP() << skip;
}

TEST(EmulatedLinksTest, BadOptionsAreNamed) {
  LinkOptions o;
  o.rate = "fast";
  absl::StatusOr<std::unique_ptr<EmulatedLinks>> links = EmulatedLinks::Create(o);
  ASSERT_FALSE(links.ok());
  if (links.status().code() == absl::StatusCode::kFailedPrecondition) {
    GTEST_SKIP() << links.status().message();
  }
  EXPECT_THAT(links.status().message(), HasSubstr("LinkOptions.rate \"fast\""));
  o.rate = "1gbit";
  o.nodes = 0;
  links = EmulatedLinks::Create(o);
  ASSERT_FALSE(links.ok());
  EXPECT_THAT(links.status().message(), HasSubstr("LinkOptions.nodes: 0"));
}

}  // namespace
}  // namespace flatshard::testing
