// The cost of a writeback End over two daemons with a state directory (issue 24: the daemons
// vote once their ranks wrote back, one more all-gather before the copies; README
// "Restarts"). Two daemons (one rank each, rank r on daemon r, 127.0.0.1 peers), one unit of
// --bytes, --warmup + --iters writeback Summon+End per rank; an iteration's End time is the
// max over the ranks. Then the same with both ranks on one daemon (no vote: its cost must not
// change). The same client code runs against --baseline_flatshardd (a build before the vote;
// default: --flatshardd itself) and --flatshardd in one run, alternated for --rounds, and the
// medians and their ratio are printed (# FIGURE lines, as bench_ab.sh reads).
//
//   build/tests/bench/flatshard_end_vote_benchmark [--flatshardd PATH]
//       [--baseline_flatshardd PATH] [--bytes 4096] [--iters 40] [--warmup 5] [--rounds 2]

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");
ABSL_FLAG(std::string, baseline_flatshardd, "",
          "the baseline daemon binary (a build before the End's vote); empty: --flatshardd");
ABSL_FLAG(int64_t, bytes, 4096, "bytes of the one unit (float32 elements x 4)");
ABSL_FLAG(int, iters, 40, "timed writeback Ends per rank and run");
ABSL_FLAG(int, warmup, 5, "untimed writeback Ends first");
ABSL_FLAG(int, rounds, 2, "runs per binary, alternated baseline/this, this/baseline, ...");

namespace flatshard::bench {
namespace {

using client::Client;
using client::ClientOptions;

// One run: `ndaemons` (1 or 2) fresh daemons of `binary`, rank r on daemon r % ndaemons;
// returns each timed iteration's End time (ms, the max over the two ranks).
absl::StatusOr<std::vector<double>> RunEnds(const std::string& binary, const std::string& tag,
                                            int ndaemons, int64_t numel, int warmup, int iters) {
  BenchDaemon daemons[2];
  std::string peers[2];
  for (int i = 0; i < ndaemons; ++i) {
    const int port = PickFreeLoopbackPort();
    if (port <= 0) return absl::InternalError("no free TCP port on 127.0.0.1");
    peers[i] = absl::StrCat("127.0.0.1:", port);
    const std::filesystem::path state =
        std::filesystem::temp_directory_path() / absl::StrCat(tag, "n", i, ".state");
    daemons[i].RemoveOnStop(state);
    absl::Status s =
        daemons[i].Start(binary, absl::StrCat(tag, "n", i),
                         {"--peer_address=" + peers[i], absl::StrCat("--node_name=node", i),
                          "--state_dir=" + state.string()},
                         {}, port);
    if (!s.ok()) return s;
  }
  std::vector<std::vector<double>> ms(2, std::vector<double>(iters, 0));
  absl::Status failed[2];
  auto rank = [&](int r) {
    ClientOptions options;
    options.address = daemons[r % ndaemons].address();
    options.call_timeout = absl::Seconds(120);
    options.join_timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    if (!c.ok()) {
      failed[r] = c.status();
      return;
    }
    if (absl::Status s = (*c)->Join("bench", 2, r, "tok", ndaemons == 1 ? "" : peers[0]); !s.ok()) {
      failed[r] = s;
      return;
    }
    absl::StatusOr<client::RegisteredModule> m =
        (*c)->Register("", ManifestJson(numel), kPolicyJson, client::InitMode::kZeros);
    if (!m.ok()) {
      failed[r] = m.status();
      return;
    }
    for (int i = 0; i < warmup + iters; ++i) {
      absl::StatusOr<std::unique_ptr<client::SummonedParams>> s = (*c)->Summon("", "", {});
      if (!s.ok()) {
        failed[r] = s.status();
        return;
      }
      const Clock::time_point t0 = Clock::now();
      if (absl::Status e = (*s)->End(); !e.ok()) {
        failed[r] = e;
        return;
      }
      if (i >= warmup) ms[r][i - warmup] = MicrosSince(t0, Clock::now()) / 1000;
    }
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  for (const absl::Status& s : failed) {
    if (!s.ok()) return s;
  }
  std::vector<double> out(iters);
  for (int i = 0; i < iters; ++i) out[i] = std::max(ms[0][i], ms[1][i]);
  return out;
}

int Main() {
  const std::string binary = absl::GetFlag(FLAGS_flatshardd);
  const std::string baseline = absl::GetFlag(FLAGS_baseline_flatshardd).empty()
                                   ? binary
                                   : absl::GetFlag(FLAGS_baseline_flatshardd);
  const int64_t numel = std::max<int64_t>(1, absl::GetFlag(FLAGS_bytes) / 4);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  for (int ndaemons : {2, 1}) {
    std::vector<double> before, after;
    for (int round = 0; round < std::max(1, absl::GetFlag(FLAGS_rounds)); ++round) {
      for (int side = 0; side < 2; ++side) {
        const bool is_baseline = (side == 0) == (round % 2 == 0);
        absl::StatusOr<std::vector<double>> t =
            RunEnds(is_baseline ? baseline : binary,
                    absl::StrCat("fsendvote-", getpid(), "-", ndaemons, "-", round,
                                 is_baseline ? "b" : "a"),
                    ndaemons, numel, warmup, iters);
        if (!t.ok()) {
          std::fprintf(stderr, "%s, %d daemon(s): %s\n", is_baseline ? "baseline" : "flatshardd",
                       ndaemons, std::string(t.status().message()).c_str());
          return 1;
        }
        std::vector<double>& into = is_baseline ? before : after;
        into.insert(into.end(), t->begin(), t->end());
      }
    }
    const double b = Median(before), a = Median(after);
    std::printf(
        "writeback End, %s, --state_dir, %lld-byte unit (median of %zu, max over ranks): "
        "baseline %.3f ms (p90 %.3f), this %.3f ms (p90 %.3f), ratio this/baseline %.2f "
        "(load %s)\n",
        ndaemons == 2 ? "2 daemons x 1 rank" : "1 daemon x 2 ranks",
        static_cast<long long>(numel * 4), after.size(), b, Percentile(before, 90), a,
        Percentile(after, 90), a / std::max(b, 1e-6), LoadAverage().c_str());
    const std::string name =
        ndaemons == 2 ? "end_vote.writeback_end_2daemons" : "end_vote.writeback_end_1daemon";
    PrintFigure(name + "_ms", a, "ms");
    PrintFigure(name + "_baseline_ms", b, "ms", true, /*context=*/true);
    PrintFigure(name + "_ratio_to_baseline", a / std::max(b, 1e-6), "x");
  }
  return 0;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flatshard::bench::Main();
}
