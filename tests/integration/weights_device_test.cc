// Published weights in GPU memory (issue 25, README "Versions in GPU memory") end to end:
// real flatshardd processes with simulated GPUs (--simulate_gpus: device memory is host shared
// memory, copies are memcpy, "IPC handles" name the slab's segment), the C++ client as
// trainers (Client::Publish with options.device) and as readers (WeightsReader with the
// simulated CUDA IPC opener).
//   - a device version holds the committed step element for element (and cast), its tensors
//     carry the GPU ordinal, a host version of the same name still works;
//   - leases and keep-K as host versions; the uid's device quota refuses a publish, naming
//     it, and nothing is published; dropping a version gives the bytes back;
//   - named errors: a GPU the daemon does not use, grants, ranks that disagree, a reader
//     without a GPU;
//   - a daemon restart: device versions are gone, readers are told so;
//   - flatshardctl weights list/inspect show the placement.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/weights_testing.h"
#include "tests/testing/cluster.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::Cluster;
using ::flatshard::testing::ClusterOptions;
using ::flatshard::testing::Layout;
using ::testing::HasSubstr;
using weights_testing::ExpectHolds;
using weights_testing::Options;
using weights_testing::Reader;
using weights_testing::Trainers;
using weights_testing::Versions;

// A reader that opens simulated device memory (what CUDA IPC gives on a real GPU).
std::unique_ptr<WeightsReader> SimulatedReader(const std::string& address) {
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = internal::WeightsReaderAccess::Connect(
      Options(address), std::make_unique<::flatshard::testing::SimulatedOpener>());
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

ClusterOptions Gpus(std::vector<std::string> more = {}) {
  ClusterOptions o;
  o.extra_flags = {"--simulate_gpus=2"};
  o.extra_flags.insert(o.extra_flags.end(), more.begin(), more.end());
  return o;
}

PublishOptions OnDevice(int device) {
  PublishOptions o;
  o.device = device;
  return o;
}

TEST(WeightsDeviceTest, AVersionOnASimulatedGpuHoldsTheCommittedStepAndNamesItsDevice) {
  Cluster d(Layout::kSingle, Gpus());
  Trainers t(d, 2, "dev", /*simulated_gpus=*/true);
  t.Step(1, /*commit=*/true);
  t.Step(2, /*commit=*/false);  // live only: never in a version
  for (const auto& p : t.Publish("gpt", OnDevice(1))) {
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->version, 1u);
    EXPECT_EQ(p->generation, 1u);
    EXPECT_EQ(p->device, 1);
  }
  std::unique_ptr<WeightsReader> r = SimulatedReader(d.AddressFor(0));
  ASSERT_NE(r, nullptr);
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->info().device, 1);
  for (const WeightsTensor& x : (*v)->tensors()) EXPECT_EQ(x.device, 1) << x.name;
  ExpectHolds(*t.plan, t.manifest, **v, 1);  // simulated device pointers are host pointers

  // Cast on the way; then a host version of the same name: each keeps its placement.
  t.Step(3, /*commit=*/true);
  PublishOptions cast = OnDevice(0);
  cast.dtype = DType::kBFloat16;
  for (const auto& p : t.Publish("gpt", cast)) ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::unique_ptr<WeightsVersion>> bf16 = r->Open("gpt");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ((*bf16)->info().version, 2u);
  EXPECT_EQ((*bf16)->tensors()[0].device, 0);
  ExpectHolds(*t.plan, t.manifest, **bf16, 3, /*bf16=*/true);
  for (const auto& p : t.Publish("gpt")) ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::unique_ptr<WeightsVersion>> host = r->Open("gpt");
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->info().device, -1);
  EXPECT_EQ((*host)->tensors()[0].device, -1);
  ExpectHolds(*t.plan, t.manifest, **host, 3);
  // Version 1 is still held and unchanged; List reports each placement.
  ExpectHolds(*t.plan, t.manifest, **v, 1);
  absl::StatusOr<std::vector<PublishedVersion>> listed = r->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<int> devices;
  for (const PublishedVersion& p : *listed) devices.push_back(p.device);
  EXPECT_THAT(devices, ::testing::ElementsAre(1, 0, -1));
}

// Leases and keep-K hold for device versions as for host ones (--weights_keep=1).
TEST(WeightsDeviceTest, AHeldDeviceVersionOutlivesKeepAndItsReleaseFreesIt) {
  Cluster d(Layout::kSingle, Gpus({"--weights_keep=1"}));
  Trainers t(d, 1, "keep", /*simulated_gpus=*/true);
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt", OnDevice(0))[0].ok());
  std::unique_ptr<WeightsReader> r = SimulatedReader(d.AddressFor(0));
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v1 = r->Open("gpt");
  ASSERT_TRUE(v1.ok()) << v1.status();
  t.Step(2, true);
  ASSERT_TRUE(t.Publish("gpt", OnDevice(0))[0].ok());
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(1, 2)) << "version 1 is held";
  ExpectHolds(*t.plan, t.manifest, **v1, 1);
  ASSERT_TRUE((*v1)->Release().ok());
  // The daemon sees the lease end when the stream's cancellation reaches it: poll.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Versions(*r, "gpt").size() != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::ElementsAre(2));
  // Two open versions in one slab share the reader's one mapping of it.
  absl::StatusOr<std::unique_ptr<WeightsVersion>> a = r->Open("gpt");
  absl::StatusOr<std::unique_ptr<WeightsVersion>> b = r->Open("gpt");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->mapping().get(), (*b)->mapping().get());
  ExpectHolds(*t.plan, t.manifest, **b, 2);
}

TEST(WeightsDeviceTest, BadDevicesGrantsAndDisagreementsAreNamedAndPublishNothing) {
  Cluster d(Layout::kSingle, Gpus());
  Trainers t(d, 2, "bad", /*simulated_gpus=*/true);
  t.Step(1, true);
  for (const auto& p : t.Publish("gpt", OnDevice(5))) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("this daemon does not use GPU 5 (its GPUs: 0, 1)"));
  }
  PublishOptions uids = OnDevice(0);
  uids.reader_uids = {4242};
  for (const auto& p : t.Publish("gpt", uids)) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("options.reader_uids must be empty"));
  }
  PublishOptions token = OnDevice(0);
  token.reader_token = "t";
  for (const auto& p : t.Publish("gpt", token)) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("options.reader_token must be empty"));
  }
  EXPECT_EQ(t.c[0]->Publish("", "gpt", OnDevice(-2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Rank 1 asks for host memory, rank 0 for GPU 1: nobody publishes.
  std::vector<absl::StatusOr<PublishedVersion>> out(2, absl::UnknownError("unset"));
  ::flatshard::testing::RunRanks(2, [&](int r) {
    out[r] = t.c[r]->Publish("", "gpt", r == 0 ? OnDevice(1) : PublishOptions{});
  });
  bool named = false;
  for (const auto& p : out) {
    EXPECT_FALSE(p.ok());
    named |= p.status().code() == absl::StatusCode::kInvalidArgument &&
             absl::StrContains(p.status().message(), "another options.device");
  }
  EXPECT_TRUE(named) << out[0].status() << " / " << out[1].status();
  std::unique_ptr<WeightsReader> r = SimulatedReader(d.AddressFor(0));
  EXPECT_THAT(Versions(*r, "gpt"), ::testing::IsEmpty());
}

TEST(WeightsDeviceTest, ADaemonWithoutGpusRefusesDeviceVersions) {
  Cluster d(Layout::kSingle);
  Trainers t(d, 1, "host");
  t.Step(1, true);
  absl::StatusOr<PublishedVersion> p = t.Publish("gpt", OnDevice(0))[0];
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("(its GPUs: none; see --gpus)"));
}

// A reader whose process cannot open the daemon's device memory (no GPU here, or a real GPU
// that cannot open a simulated handle) gets an error naming the version and the GPU.
TEST(WeightsDeviceTest, AReaderThatCannotOpenDeviceMemoryIsToldWhy) {
  Cluster d(Layout::kSingle, Gpus());
  Trainers t(d, 1, "nogpu", /*simulated_gpus=*/true);
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt", OnDevice(1))[0].ok());
  std::unique_ptr<WeightsReader> r = Reader(d.AddressFor(0));  // the CUDA IPC opener
  absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(v.status().message(),
              HasSubstr("Open of weights \"gpt\" version 1: it is in device memory of the "
                        "daemon's GPU 1 (SIM-GPU-1)"));
  // The failed open holds no lease: keep-K frees the version as usual afterwards.
  absl::StatusOr<std::vector<PublishedVersion>> l = r->List();
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->size(), 1u);
  EXPECT_EQ((*l)[0].device, 1);
}

// The uid's device bytes (its shards and its device versions) are bounded by
// --gpu_memory_quota_mib_per_uid: the publish that would pass it fails naming the uid and the
// quota, and leaves nothing; a drop gives the bytes back.
TEST(WeightsDeviceTest, TheUidsDeviceQuotaRefusesAPublishNamingItAndDropGivesBytesBack) {
  Cluster d(Layout::kSingle, Gpus({"--gpu_memory_quota_mib_per_uid=1", "--weights_keep=1000"}));
  Trainers t(d, 1, "quota", /*simulated_gpus=*/true);
  t.Step(1, true);
  std::unique_ptr<WeightsReader> r = SimulatedReader(d.AddressFor(0));
  absl::Status refused;
  int published = 0;
  // gpt_tied is ~40 KB: some 20 versions fit in 1 MiB next to the shards.
  for (int i = 0; i < 200 && refused.ok(); ++i) {
    absl::StatusOr<PublishedVersion> p = t.Publish("gpt", OnDevice(i % 2))[0];
    if (p.ok()) {
      ++published;
    } else {
      refused = p.status();
    }
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_GT(published, 1);
  EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("uid ", ::getuid(), " cannot allocate")));
  EXPECT_THAT(refused.message(), HasSubstr("of its GPU memory quota of 1048576 bytes "
                                           "(--gpu_memory_quota_mib_per_uid)"));
  EXPECT_EQ(Versions(*r, "gpt").size(), static_cast<size_t>(published)) << "nothing published";
  // Host versions are not bounded by the device quota.
  ASSERT_TRUE(t.Publish("gpt")[0].ok());
  // Dropping device version 1 (flatshardctl) gives its bytes back: the next fits.
  const std::string ctl = absl::StrCat(std::string(FS_BINARY_DIR), "/client/flatshardctl weights ");
  const std::string cmd = ctl + "drop gpt --version 1" + " --socket " + d.SocketFor(0);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  absl::StatusOr<PublishedVersion> again = t.Publish("gpt", OnDevice(1))[0];
  EXPECT_TRUE(again.ok()) << again.status();
}

// Device versions are not stored: after a daemon restart (kill -9, with a state directory)
// readers get NOT_FOUND saying so, and the name's older stored host version does not come
// back in its place.
TEST(WeightsDeviceTest, DeviceVersionsDoNotSurviveARestartAndReadersAreToldSo) {
  char tmpl[] = "/tmp/fswd-state.XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string state = tmpl;
  {
    Cluster d(Layout::kSingle, Gpus({absl::StrCat("--state_dir=", state)}));
    {
      Trainers t(d, 1, "restart", /*simulated_gpus=*/true);
      t.Step(1, true);
      ASSERT_TRUE(t.Publish("gpt")[0].ok());  // host: stored
      t.Step(2, true);
      ASSERT_TRUE(t.Publish("gpt", OnDevice(0))[0].ok());
    }
    // Publish answers before the worker stores (here: removes) the name's file; the next
    // publish of any name waits for that, so one more (host, another name) orders it.
    {
      Trainers t(d, 1, "order", /*simulated_gpus=*/true);
      t.Step(1, true);
      ASSERT_TRUE(t.Publish("other")[0].ok());
    }
    d.Kill(0);
    ASSERT_TRUE(d.Restart(0));
    std::unique_ptr<WeightsReader> r = SimulatedReader(d.AddressFor(0));
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = r->Open("gpt");
    EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound) << v.status();
    EXPECT_THAT(v.status().message(), HasSubstr("versions in GPU memory never do"));
  }
  std::error_code ignored;
  std::filesystem::remove_all(state, ignored);
}

// flatshardctl weights list/inspect show where a version lives.
TEST(WeightsDeviceTest, FlatshardctlShowsThePlacement) {
  Cluster d(Layout::kSingle, Gpus());
  Trainers t(d, 1, "ctl", /*simulated_gpus=*/true);
  t.Step(1, true);
  ASSERT_TRUE(t.Publish("gpt", OnDevice(1))[0].ok());
  ASSERT_TRUE(t.Publish("cpu")[0].ok());
  const std::string ctl = absl::StrCat(std::string(FS_BINARY_DIR), "/client/flatshardctl weights ");
  const std::string sock = absl::StrCat(" --socket ", d.SocketFor(0));
  auto run = [](const std::string& cmd) {
    std::string out;
    FILE* f = popen(cmd.c_str(), "r");
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    EXPECT_EQ(pclose(f), 0) << cmd << "\n" << out;
    return out;
  };
  std::string out = run(ctl + "list --json" + sock);
  EXPECT_THAT(out, HasSubstr("\"placement\": \"gpu:1\""));
  EXPECT_THAT(out, HasSubstr("\"placement\": \"host\""));
  out = run(ctl + "list" + sock);
  EXPECT_THAT(out, HasSubstr("PLACEMENT"));
  EXPECT_THAT(out, HasSubstr("gpu:1"));
  out = run(ctl + "inspect gpt" + sock);
  EXPECT_THAT(out, HasSubstr("on GPU 1 SIM-GPU-1 at offset"));
  out = run(ctl + "inspect gpt --json" + sock);
  EXPECT_THAT(out, HasSubstr("\"device_uuid\": \"SIM-GPU-1\""));
}

}  // namespace
}  // namespace flatshard::client
