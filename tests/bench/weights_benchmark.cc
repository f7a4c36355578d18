// Published weights (README "Publishing weights", issue 25), same-run ratios:
//   - publish: Client::Publish of a committed model of --bytes (one float32 parameter, world
//     size 1, --weights_keep=1; the RPC, the hold, the copy, the seal) against one memcpy of the
//     same bytes into a fresh shm segment (first touch of every page) and into that segment
//     again (touched). The first two publishes of a name copy into fresh segments (compared
//     with the fresh memcpy); later ones into the spare segment of the version that fell out
//     (compared with the touched memcpy; target <= 1.2x). The same for a bfloat16 cast of it
//     (--cast: what the cast costs on top);
//   - open: WeightsReader::Open + Release of a version of --bytes against one of --small_bytes
//     (target: independent of size, <= 1 ms plus the mapping);
//   - readers: --readers readers opening the same version map one segment (bytes copied on the
//     node: one copy, the publish's).
//
//   build/tests/bench/flatshard_weights_benchmark [--bytes 1073741824] [--repeats 5]

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "bytes of the published model (float32 x 4)");
ABSL_FLAG(int64_t, small_bytes, int64_t{1} << 20, "bytes of the small model Open compares with");
ABSL_FLAG(int, repeats, 5,
          "publishes and memcpys measured (>= 3: the first two of a name are into fresh "
          "segments; medians are reported)");
ABSL_FLAG(bool, cast, true, "also publish a bfloat16 cast of the model (name big-bf16)");
ABSL_FLAG(int, opens, 50, "opens measured per size (the median is reported)");
ABSL_FLAG(int, readers, 4, "readers opening one version");
ABSL_FLAG(std::string, state_dir, "",
          "the daemon's --state_dir (its newest version of each name is then written to disk "
          "before Publish answers); empty: --ephemeral");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;
using client::WeightsReader;
using client::WeightsVersion;

// The /dev/shm file mapped at `p` in this process ("" when none).
std::string SegmentOf(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || addr < lo || addr >= hi) continue;
    const size_t at = line.find("/dev/shm/");
    return at == std::string::npos ? "" : line.substr(at);
  }
  return "";
}

// A group of one rank with a model of `bytes` committed (values written first).
absl::StatusOr<std::unique_ptr<Client>> Trainer(const BenchDaemon& d, const std::string& group,
                                                int64_t bytes) {
  ClientOptions options;
  options.address = d.address();
  options.call_timeout = absl::Seconds(300);
  FS_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Connect(options));
  FS_RETURN_IF_ERROR(c->Join(group, 1, 0, "tok"));
  FS_ASSIGN_OR_RETURN(
      client::RegisteredModule m,
      c->Register("", ManifestJson(bytes / 4), kPolicyJson, client::InitMode::kZeros));
  for (const client::UnitShardView& u : m.shards) {
    std::memset(u.data, 0x3f, static_cast<size_t>(u.shard_numel) * 4);
  }
  FS_RETURN_IF_ERROR(c->Commit("").status());
  return c;
}

std::vector<std::string> Flags() {
  std::vector<std::string> flags = {"--weights_keep=1"};
  if (!absl::GetFlag(FLAGS_state_dir).empty()) {
    flags.push_back("--state_dir=" + absl::GetFlag(FLAGS_state_dir));
  }
  return flags;
}

// One memcpy of `bytes` into a fresh shm segment (*fresh: every page touched first here) and
// then into the same segment again (*touched).
bool MemcpyMs(int64_t bytes, const void* src, double* fresh, double* touched) {
  const std::string name = absl::StrCat("/fswbench-memcpy-", ::getpid());
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return false;
  ::shm_unlink(name.c_str());
  void* dst = ::ftruncate(fd, bytes) == 0
                  ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
  ::close(fd);
  if (dst == MAP_FAILED) return false;
  Clock::time_point t0 = Clock::now();
  std::memcpy(dst, src, bytes);
  *fresh = MicrosSince(t0, Clock::now()) / 1000;
  t0 = Clock::now();
  std::memcpy(dst, src, bytes);
  *touched = MicrosSince(t0, Clock::now()) / 1000;
  ::munmap(dst, bytes);
  return true;
}

// Publishes `name` `repeats` times: the milliseconds of each.
absl::StatusOr<std::vector<double>> PublishMs(Client& c, const std::string& name, int repeats,
                                              const client::PublishOptions& options) {
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const Clock::time_point t0 = Clock::now();
    FS_RETURN_IF_ERROR(c.Publish("", name, options).status());
    ms.push_back(MicrosSince(t0, Clock::now()) / 1000);
  }
  return ms;
}

double MedianOf(const std::vector<double>& v, size_t from, size_t to) {
  return Median(std::vector<double>(v.begin() + std::min(from, v.size()),
                                    v.begin() + std::min(to, v.size())));
}

absl::StatusOr<double> OpenMs(WeightsReader& r, const std::string& name, int opens) {
  std::vector<double> ms;
  for (int i = 0; i < opens; ++i) {
    const Clock::time_point t0 = Clock::now();
    FS_ASSIGN_OR_RETURN(std::unique_ptr<WeightsVersion> v, r.Open(name));
    ms.push_back(MicrosSince(t0, Clock::now()) / 1000);
    FS_RETURN_IF_ERROR(v->Release());
  }
  return Median(ms);
}

int Run() {
  const int64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int64_t small = absl::GetFlag(FLAGS_small_bytes);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  BenchDaemon d;
  ScopedStopOnSignal stop(&d);
  if (absl::Status s = d.Start(absl::GetFlag(FLAGS_flatshardd), "fswbench", Flags()); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Client>> big = Trainer(d, "big", bytes);
  absl::StatusOr<std::unique_ptr<Client>> little = Trainer(d, "little", small);
  if (!big.ok() || !little.ok()) {
    std::fprintf(stderr, "setup: %s %s\n", big.status().ToString().c_str(),
                 little.status().ToString().c_str());
    return 1;
  }
  if (repeats < 3) {
    std::fprintf(stderr, "--repeats must be >= 3\n");
    return 1;
  }
  std::vector<char> src(static_cast<size_t>(bytes), 0x3f);
  std::vector<double> fresh, warm;
  for (int i = 0; i < repeats; ++i) {
    double f = 0, w = 0;
    if (!MemcpyMs(bytes, src.data(), &f, &w)) {
      std::fprintf(stderr, "memcpy baseline: cannot make a shm segment of %lld bytes\n",
                   static_cast<long long>(bytes));
      return 1;
    }
    fresh.push_back(f);
    warm.push_back(w);
  }
  absl::StatusOr<std::vector<double>> publish = PublishMs(**big, "big", repeats, {});
  client::PublishOptions bf16;
  bf16.dtype = DType::kBFloat16;
  absl::StatusOr<std::vector<double>> cast = absl::GetFlag(FLAGS_cast)
                                                 ? PublishMs(**big, "big-bf16", repeats, bf16)
                                                 : std::vector<double>(repeats, 0.0);
  if (!publish.ok() || !cast.ok()) {
    std::fprintf(stderr, "publish: %s %s\n", publish.status().ToString().c_str(),
                 cast.status().ToString().c_str());
    return 1;
  }
  src.clear();
  src.shrink_to_fit();
  if (absl::StatusOr<client::PublishedVersion> v = (*little)->Publish("", "little"); !v.ok()) {
    std::fprintf(stderr, "publish: %s\n", v.status().ToString().c_str());
    return 1;
  }
  ClientOptions ro;
  ro.address = d.address();
  absl::StatusOr<std::unique_ptr<WeightsReader>> r = WeightsReader::Connect(ro);
  if (!r.ok()) return 1;
  absl::StatusOr<double> open_big = OpenMs(**r, "big", absl::GetFlag(FLAGS_opens));
  absl::StatusOr<double> open_small = OpenMs(**r, "little", absl::GetFlag(FLAGS_opens));
  if (!open_big.ok() || !open_small.ok()) {
    std::fprintf(stderr, "open: %s %s\n", open_big.status().ToString().c_str(),
                 open_small.status().ToString().c_str());
    return 1;
  }
  // Several readers: one segment for all of them.
  std::set<std::string> segments;
  std::vector<std::unique_ptr<WeightsVersion>> held;
  for (int i = 0; i < absl::GetFlag(FLAGS_readers); ++i) {
    absl::StatusOr<std::unique_ptr<WeightsReader>> ri = WeightsReader::Connect(ro);
    if (!ri.ok()) return 1;
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v = (*ri)->Open("big");
    if (!v.ok()) return 1;
    segments.insert(SegmentOf((*v)->tensors()[0].data));
    held.push_back(*std::move(v));
  }
  // --weights_keep=1: publishes 1 and 2 copy into fresh segments, later ones into the spare.
  const double pf = MedianOf(*publish, 0, 2), p = MedianOf(*publish, 2, repeats);
  const double cf = MedianOf(*cast, 0, 2), cw = MedianOf(*cast, 2, repeats);
  const double f = Median(fresh), w = Median(warm);
  std::printf(
      "memcpy of %s into a fresh shm segment: %.1f ms, into it again (touched): %.1f ms "
      "(median of %d)\n",
      SizeName(bytes).c_str(), f, w, repeats);
  std::printf(
      "publish of %s into a reused segment: %.1f ms = %.2fx the touched memcpy (median of %d)\n",
      SizeName(bytes).c_str(), p, p / w, repeats - 2);
  std::printf("publish of %s into a fresh segment: %.1f ms = %.2fx the fresh memcpy (first two)\n",
              SizeName(bytes).c_str(), pf, pf / f);
  if (absl::GetFlag(FLAGS_cast)) {
    std::printf(
        "publish cast to bfloat16: %.1f ms reused (%.2fx the touched float32 memcpy), %.1f ms "
        "fresh\n",
        cw, cw / w, cf);
  }
  std::printf("open+map of a %s version: %.3f ms; of a %s version: %.3f ms (median of %d)\n",
              SizeName(bytes).c_str(), *open_big, SizeName(small).c_str(), *open_small,
              absl::GetFlag(FLAGS_opens));
  std::printf("%zu readers of one version map %zu segment(s): the node holds one copy\n",
              held.size(), segments.size());
  PrintFigure("weights.publish_ms", p, "ms");
  PrintFigure("weights.publish_over_memcpy_touched", p / w, "x");
  PrintFigure("weights.publish_fresh_over_memcpy_fresh", pf / f, "x");
  PrintFigure("weights.publish_bf16_over_memcpy_touched", cw / w, "x");
  PrintFigure("weights.memcpy_touched_ms", w, "ms", true, /*context=*/true);
  PrintFigure("weights.memcpy_fresh_ms", f, "ms", true, /*context=*/true);
  PrintFigure("weights.open_big_ms", *open_big, "ms");
  PrintFigure("weights.open_small_ms", *open_small, "ms");
  PrintFigure("weights.segments_for_readers", static_cast<double>(segments.size()), "segments");
  return segments.size() == 1 ? 0 : 1;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  flatshard::bench::StartSignalThread(argv[0]);
  const int rc = flatshard::bench::Run();
  while (flatshard::bench::Interrupted()) pause();
  return rc;
}
