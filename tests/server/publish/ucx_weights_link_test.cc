// UcxWeightsLink (server/publish/ucx_weights_link.h): a range of a registered segment read
// with UCX gets, byte for byte (also a range of many chunks into a registered destination); a
// source process killed with SIGKILL fails the next get (within its deadline, no hang); a
// shut-down link refuses; a bad --ucx_error_handling named.

#include "server/publish/ucx_weights_link.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBytes = size_t{1} << 20;

std::vector<uint8_t> Pattern() {
  std::vector<uint8_t> v(kBytes);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 131 + 7) % 251);
  return v;
}

std::unique_ptr<UcxWeightsLink> MakeLink() {
  absl::StatusOr<std::unique_ptr<UcxWeightsLink>> link = UcxWeightsLink::Create("auto");
  if (!link.ok()) return nullptr;
  return *std::move(link);
}

TEST(UcxWeightsLinkTest, AGetFromAKilledSourceProcessFailsWithinItsDeadline) {
  // First in this file: the fork comes before this process starts UCX (its threads).
  int to_parent[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The source: exposes the pattern, tells the parent where it is, and waits to be killed.
    ::close(to_parent[0]);
    std::unique_ptr<UcxWeightsLink> link = MakeLink();
    if (link == nullptr) ::_exit(2);
    static const std::vector<uint8_t> src = Pattern();
    absl::StatusOr<UcxWeightsLink::Exposure> e = link->Expose(src.data(), src.size());
    if (!e.ok()) ::_exit(3);
    for (const std::string* s : {&e->address, &e->rkey}) {
      const uint64_t n = s->size();
      if (::write(to_parent[1], &n, sizeof(n)) != sizeof(n)) ::_exit(4);
      if (::write(to_parent[1], s->data(), n) != static_cast<ssize_t>(n)) ::_exit(4);
    }
    if (::write(to_parent[1], &e->base, sizeof(e->base)) != sizeof(e->base)) ::_exit(4);
    while (true) ::pause();
  }
  ::close(to_parent[1]);
  auto read_all = [&](void* p, size_t n) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(to_parent[0], static_cast<char*>(p) + got, n - got);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  };
  std::string address, rkey;
  uint64_t base = 0;
  bool ok = true;
  for (std::string* s : {&address, &rkey}) {
    uint64_t n = 0;
    ok = ok && read_all(&n, sizeof(n));
    if (ok) s->resize(n);
    ok = ok && read_all(s->data(), n);
  }
  ok = ok && read_all(&base, sizeof(base));
  ::close(to_parent[0]);
  if (!ok) {
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 2) {
      GTEST_SKIP() << "UCX is not available in this build";
    }
    FAIL() << "the source process did not say where its segment is (status " << status << ")";
  }
  std::unique_ptr<UcxWeightsLink> puller = MakeLink();
  ASSERT_NE(puller, nullptr);
  std::vector<uint8_t> dst(kBytes, 0);
  absl::Status first = puller->Get(address, rkey, base, dst.data(), kBytes,
                                   absl::Now() + absl::Seconds(60), nullptr);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ASSERT_TRUE(first.ok()) << first;
  EXPECT_EQ(dst, Pattern());
  // The source is gone: the get fails (UCX's peer error, or the deadline), it never hangs.
  const absl::Status after = puller->Get(address, rkey, base, dst.data(), kBytes,
                                         absl::Now() + absl::Seconds(30), nullptr);
  EXPECT_FALSE(after.ok());
  EXPECT_TRUE(after.code() == absl::StatusCode::kUnavailable ||
              after.code() == absl::StatusCode::kDeadlineExceeded)
      << after;
}

TEST(UcxWeightsLinkTest, AGetReadsTheRangeOfTheRegisteredSegmentByteForByte) {
  std::unique_ptr<UcxWeightsLink> source = MakeLink();
  if (source == nullptr) GTEST_SKIP() << "UCX is not available in this build";
  std::unique_ptr<UcxWeightsLink> puller = MakeLink();
  ASSERT_NE(puller, nullptr);
  const std::vector<uint8_t> src = Pattern();
  absl::StatusOr<UcxWeightsLink::Exposure> e = source->Expose(src.data(), src.size());
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<uint8_t> dst(kBytes, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  // Two ranges, as two sources' shares would be.
  const size_t half = kBytes / 2 + 4096;
  ASSERT_TRUE(puller->Get(e->address, e->rkey, e->base, dst.data(), half, deadline, nullptr).ok());
  ASSERT_TRUE(puller
                  ->Get(e->address, e->rkey, e->base + half, dst.data() + half, kBytes - half,
                        deadline, nullptr)
                  .ok());
  EXPECT_EQ(dst, src);
  puller->Shutdown();
  source->Shutdown();
}

TEST(UcxWeightsLinkTest, ARangeOfManyChunksLandsInARegisteredDestinationByteForByte) {
  std::unique_ptr<UcxWeightsLink> source = MakeLink();
  if (source == nullptr) GTEST_SKIP() << "UCX is not available in this build";
  std::unique_ptr<UcxWeightsLink> puller = MakeLink();
  ASSERT_NE(puller, nullptr);
  // More chunks than gets in flight, and a partial last chunk.
  const size_t bytes = UcxWeightsLink::kGetChunk * (UcxWeightsLink::kGetsInFlight + 3) + 12345;
  std::vector<uint8_t> src(bytes);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>((i * 131 + i / 4099) % 251);
  absl::StatusOr<UcxWeightsLink::Exposure> e = source->Expose(src.data(), src.size());
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<uint8_t> dst(bytes + 8192, 0);
  absl::StatusOr<UcxWeightsLink::Registration> reg = puller->Register(dst.data(), dst.size());
  ASSERT_TRUE(reg.ok()) << reg.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  // At an offset inside the registration, as a source's share of a segment.
  const absl::Status got = puller->Get(e->address, e->rkey, e->base, dst.data() + 4096, bytes,
                                       deadline, nullptr, "test", &*reg);
  ASSERT_TRUE(got.ok()) << got;
  EXPECT_TRUE(std::memcmp(dst.data() + 4096, src.data(), bytes) == 0);
  EXPECT_EQ(dst[4095], 0);
  EXPECT_EQ(dst[4096 + bytes], 0);
  // A destination outside the registration is refused before any byte moves.
  std::vector<uint8_t> other(4096, 0);
  const absl::Status outside = puller->Get(e->address, e->rkey, e->base, other.data(), other.size(),
                                           deadline, nullptr, "test", &*reg);
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument) << outside;
  EXPECT_THAT(outside.message(), HasSubstr("outside its registration"));
  reg->mapping.reset();
  puller->Shutdown();
  source->Shutdown();
}

TEST(UcxWeightsLinkTest, AShutDownLinkRefusesAndABadModeIsNamed) {
  std::unique_ptr<UcxWeightsLink> link = MakeLink();
  if (link == nullptr) GTEST_SKIP() << "UCX is not available in this build";
  link->Shutdown();
  link->Shutdown();  // idempotent
  const std::vector<uint8_t> src = Pattern();
  EXPECT_EQ(link->Expose(src.data(), src.size()).status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<std::unique_ptr<UcxWeightsLink>> bad = UcxWeightsLink::Create("sometimes");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--ucx_error_handling"));
  absl::StatusOr<std::unique_ptr<UcxWeightsLink>> none =
      OpenWeightsLink("tcp", "auto", /*copies=*/false);
  EXPECT_THAT(none.status().message(), HasSubstr("--weights_transport"));
}

}  // namespace
}  // namespace flatshard::server
