// Device versions of a group on several daemons (issue 25, README "Versions in GPU memory"):
// real flatshardd processes with simulated GPUs (--simulate_gpus: device memory is host shared
// memory) and peer ports, trainers on both, readers through each daemon's (simulated) CUDA IPC.
//   - one publish with options.device = 1 places the version in GPU 1 of each daemon, same
//     number and generation, element for element (and cast to bfloat16), read through each
//     daemon;
//   - a daemon without that GPU (the leader or another one) fails the publish on every rank,
//     naming the daemon and the GPU, and nothing is published anywhere; the next one works;
//   - the leader killed with SIGKILL at a random point of a publish loop leaves only whole
//     versions on the other daemon.

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/weights_multi_testing.h"

namespace flatshard::client {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using weights_testing::DaemonProcess;
using weights_testing::ExpectHolds;
using weights_testing::GroupDaemon;
using weights_testing::Options;
using weights_testing::Trainers;

std::unique_ptr<DaemonProcess> GpuDaemon(int i, int gpus) {
  return GroupDaemon(i, {absl::StrCat("--simulate_gpus=", gpus)});
}

// A reader that opens simulated device memory (what CUDA IPC gives on a real GPU).
std::unique_ptr<WeightsReader> SimulatedReader(const DaemonProcess& d) {
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = internal::WeightsReaderAccess::Connect(
      Options(d.address()), std::make_unique<::flatshard::testing::SimulatedOpener>());
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

std::vector<PublishedVersion> ListOf(const DaemonProcess& d) {
  absl::StatusOr<std::vector<PublishedVersion>> l = SimulatedReader(d)->List();
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? *l : std::vector<PublishedVersion>{};
}

PublishOptions OnDevice(int device) {
  PublishOptions o;
  o.device = device;
  return o;
}

TEST(WeightsDeviceMultiTest, APublishPlacesTheVersionInTheGpuOfEachDaemon) {
  std::unique_ptr<DaemonProcess> d0 = GpuDaemon(0, 2);
  std::unique_ptr<DaemonProcess> d1 = GpuDaemon(1, 2);
  Trainers t({d0.get(), d1.get()}, "devmulti", absl::Seconds(20), /*simulated_gpus=*/true);
  ASSERT_NE(t.plan, nullptr);
  t.Step(3);
  std::vector<absl::StatusOr<PublishedVersion>> p = t.Publish("gpt", OnDevice(1));
  for (const auto& x : p) {
    ASSERT_TRUE(x.ok()) << x.status();
    EXPECT_EQ(x->version, 1u);
    EXPECT_EQ(x->generation, p[0]->generation);
    EXPECT_EQ(x->device, 1);
  }
  std::vector<std::unique_ptr<WeightsVersion>> held;
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    std::unique_ptr<WeightsReader> r = SimulatedReader(*d);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    ASSERT_TRUE(v.ok()) << d->peer_address() << ": " << v.status();
    EXPECT_EQ((*v)->info().version, 1u);
    EXPECT_EQ((*v)->info().generation, p[0]->generation);
    EXPECT_EQ((*v)->info().device, 1);
    for (const WeightsTensor& x : (*v)->tensors()) EXPECT_EQ(x.device, 1) << x.name;
    ExpectHolds(*t.plan, **v, 3);  // simulated device pointers are host pointers
    held.push_back(*std::move(v));
  }
  // The next step to GPU 0 cast to bfloat16 (on the leader, before the copies), then as a
  // host version: each daemon numbers and places them alike, the cast version holds the
  // host one's values rounded (the pattern is exact in bfloat16), and version 1 is unchanged.
  t.Step(4);
  PublishOptions cast = OnDevice(0);
  cast.dtype = DType::kBFloat16;
  for (const auto& x : t.Publish("gpt", cast)) ASSERT_TRUE(x.ok()) << x.status();
  for (const auto& x : t.Publish("gpt")) ASSERT_TRUE(x.ok()) << x.status();
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    std::vector<int> devices;
    for (const PublishedVersion& v : ListOf(*d)) devices.push_back(v.device);
    EXPECT_THAT(devices, ::testing::ElementsAre(1, 0, -1)) << d->peer_address();
    std::unique_ptr<WeightsReader> r = SimulatedReader(*d);
    OpenWeightsOptions two;
    two.version = 2;
    absl::StatusOr<std::unique_ptr<WeightsVersion>> bf16 = r->Open("gpt", two);
    absl::StatusOr<std::unique_ptr<WeightsVersion>> host = r->Open("gpt");
    ASSERT_TRUE(bf16.ok() && host.ok()) << bf16.status() << " / " << host.status();
    EXPECT_EQ((*bf16)->info().device, 0);
    ExpectHolds(*t.plan, **host, 4);
    ASSERT_EQ((*bf16)->tensors().size(), (*host)->tensors().size());
    for (const WeightsTensor& f : (*host)->tensors()) {
      const WeightsTensor* b = (*bf16)->Find(f.name);
      ASSERT_NE(b, nullptr) << f.name;
      EXPECT_EQ(b->dtype, DType::kBFloat16) << f.name;
      ASSERT_EQ(b->bytes * 2, f.bytes) << f.name;
      for (int64_t j = 0; j < f.bytes / 4; ++j) {
        uint32_t bits = 0;
        std::memcpy(&bits, static_cast<const char*>(f.data) + j * 4, 4);
        ASSERT_EQ(static_cast<const uint16_t*>(b->data)[j], static_cast<uint16_t>(bits >> 16))
            << f.name << "[" << j << "]";
      }
    }
  }
  for (const auto& v : held) ExpectHolds(*t.plan, *v, 3);
}

// Every rank's error names the daemon without the GPU; neither daemon holds a version.
void ExpectRefusedEverywhere(const std::vector<absl::StatusOr<PublishedVersion>>& p,
                             const std::string& daemon, const DaemonProcess& d0,
                             const DaemonProcess& d1) {
  for (size_t r = 0; r < p.size(); ++r) {
    ASSERT_FALSE(p[r].ok()) << "rank " << r;
    EXPECT_EQ(p[r].status().code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << p[r].status();
    EXPECT_THAT(p[r].status().message(), HasSubstr(daemon)) << "rank " << r;
    EXPECT_THAT(p[r].status().message(), HasSubstr("does not use GPU 1 (its GPUs: 0)"))
        << "rank " << r;
  }
  EXPECT_THAT(ListOf(d0), IsEmpty());
  EXPECT_THAT(ListOf(d1), IsEmpty());
}

TEST(WeightsDeviceMultiTest, ADaemonWithoutTheGpuFailsThePublishEverywhereNamingIt) {
  std::unique_ptr<DaemonProcess> d0 = GpuDaemon(0, 2);
  std::unique_ptr<DaemonProcess> d1 = GpuDaemon(1, 1);  // no GPU 1
  Trainers t({d0.get(), d1.get()}, "nogpu1", absl::Seconds(20), /*simulated_gpus=*/true);
  ASSERT_NE(t.plan, nullptr);
  t.Step(2);
  ExpectRefusedEverywhere(t.Publish("gpt", OnDevice(1)), d1->peer_address(), *d0, *d1);
  // The refusal was that publish's only: GPU 0 (on both) works next.
  for (const auto& x : t.Publish("gpt", OnDevice(0))) ASSERT_TRUE(x.ok()) << x.status();
  for (const DaemonProcess* d : {d0.get(), d1.get()}) {
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = SimulatedReader(*d)->Open("gpt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ((*v)->info().version, 1u);
    ExpectHolds(*t.plan, **v, 2);
  }
}

TEST(WeightsDeviceMultiTest, ALeaderWithoutTheGpuFailsThePublishEverywhereNamingIt) {
  std::unique_ptr<DaemonProcess> d0 = GpuDaemon(0, 1);  // rank 0's daemon: no GPU 1
  std::unique_ptr<DaemonProcess> d1 = GpuDaemon(1, 2);
  Trainers t({d0.get(), d1.get()}, "nogpu0", absl::Seconds(20), /*simulated_gpus=*/true);
  ASSERT_NE(t.plan, nullptr);
  t.Step(2);
  ExpectRefusedEverywhere(t.Publish("gpt", OnDevice(1)), "rank 0's daemon (the publish leader)",
                          *d0, *d1);
  for (const auto& x : t.Publish("gpt", OnDevice(0))) ASSERT_TRUE(x.ok()) << x.status();
}

// The leader killed with SIGKILL at a random point of a loop of device publishes: the other
// daemon holds only whole versions, each the committed step it names (no partial copy, no
// upload of a version the leader did not finish).
TEST(WeightsDeviceMultiTest, TheLeaderKilledMidPublishLeavesOnlyWholeVersionsOnTheOther) {
  std::unique_ptr<DaemonProcess> d0 = GpuDaemon(0, 2);
  std::unique_ptr<DaemonProcess> d1 = GpuDaemon(1, 2);
  Trainers t({d0.get(), d1.get()}, "killleader", absl::Seconds(20), /*simulated_gpus=*/true);
  ASSERT_NE(t.plan, nullptr);
  std::thread loop([&] {
    for (int s = 1;; ++s) {
      std::vector<absl::Status> failed(weights_testing::kWorld);
      ::flatshard::testing::RunRanks(weights_testing::kWorld, [&](int r) {
        absl::StatusOr<ShardViews> v = t.c[r]->GetShardViews("");
        failed[r] = v.status();
        if (!v.ok()) return;
        weights_testing::FillShards(*v, s);
        failed[r] = t.c[r]->Commit("").status();
        if (failed[r].ok()) failed[r] = t.c[r]->Publish("", "gpt", OnDevice(1)).status();
      });
      for (const absl::Status& f : failed) {
        if (!f.ok()) return;  // the leader is gone
      }
    }
  });
  // Once daemon 1 holds a version, a random point of the loop.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (ListOf(*d1).empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  std::mt19937 rng(2525);
  absl::SleepFor(absl::Milliseconds(rng() % 400));
  d0->Kill();
  loop.join();
  const std::vector<PublishedVersion> all = ListOf(*d1);
  ASSERT_FALSE(all.empty()) << "daemon 1 never got a version";
  std::unique_ptr<WeightsReader> r = SimulatedReader(*d1);
  for (const PublishedVersion& pv : all) {
    EXPECT_EQ(pv.device, 1);
    OpenWeightsOptions o;
    o.version = pv.version;
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open(pv.name, o);
    ASSERT_TRUE(v.ok()) << v.status();
    // The generation is the number of commits: step s is generation s.
    ExpectHolds(*t.plan, **v, static_cast<int>(pv.generation));
  }
}

}  // namespace
}  // namespace flatshard::client
