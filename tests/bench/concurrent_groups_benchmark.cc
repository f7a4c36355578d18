// Concurrent groups on one daemon (never part of the default test run): do two jobs that share
// a flatshardd serialise each other?
//
//   build/tests/bench/flatshard_concurrent_groups_benchmark [--groups 1,2,4] [--ranks 1]
//       [--bytes 4KiB,64MiB] [--iters 500] [--warmup 50] [--variants read,writeback,commit]
//       [--with_state_dir off,on] [--state_dir_root DIR] [--daemon_flags F1,F2]
//       [--flatshardd PATH]
//
// One real flatshardd process per row (private socket and segment prefix, fresh for every row
// so that each G starts from the same state). For G in --groups: G groups (jobs), each with
// --ranks ranks; every rank is a thread with its own flatshard::client::Client on its own
// connection (a symlink to the daemon's socket per client: gRPC would otherwise share one
// connection between equal channels of this process). Each group registers its own model, one
// unit of --bytes float32, then all G x R ranks run, behind one barrier, --iters operations
// (after --warmup) of each variant:
//   read       Summon(writeback=false) + End: the unshard every forward pass does.
//   writeback  Summon(writeback=true), one element written, End: the End writes back and
//              commits (an agreement, and fsynced records with --state_dir).
//   commit     one element of the shard written, Commit: the optimizer step's close.
// Units over 1 MiB run a tenth of --iters / --warmup (at least 5 / 1).
//
// Per row: p50/p99 of the operation's latency as each rank saw it (Summon + End; Commit),
// aggregate throughput (operations completed by all ranks per second, from the barrier to the
// last rank's finish), and against the G=1 row (the smallest G given) of the same
// size/variant: speedup = throughput(G) / throughput(1) and p50(G) / p50(1). Groups that
// serialise on one lock show speedup ~1 and p50 ratio ~G; independent groups show speedup ~G
// (capped by the cores: trainers and daemon share this host) and p50 ratio ~1. The daemon's
// CPU use over the row (cores) tells the two apart on a small machine: serialised groups leave
// the daemon's CPU use flat as G grows.
//
// --with_state_dir on starts the daemon with --state_dir (a fresh directory under
// --state_dir_root, default $TMPDIR, removed at exit): each commit (Commit, writeback End)
// writes fsynced records, durable work that serialises groups when it runs under a shared
// lock or on a shared thread. Read summons write no records: the read variant runs only with
// the state directory off.
//
// Prints "# FIGURE name value unit lower|higher" lines for scripts/bench_ab.sh. Exits non-zero
// with a message on any error. Daemons, their socket directories, state directories and
// /dev/shm/<prefix>.* are removed at exit (also on error and on SIGINT/SIGTERM; a daemon gets
// SIGTERM if this process dies).

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "flatshard/client.h"
#include "tests/bench/bench_support.h"

ABSL_FLAG(std::vector<std::string>, groups, std::vector<std::string>({"1", "2"}),
          "numbers of concurrent groups on the one daemon, comma-separated (the smallest is the "
          "base of the ratios; include 1)");
ABSL_FLAG(int32_t, ranks, 1, "ranks per group (threads, all on this host and daemon)");
ABSL_FLAG(std::vector<std::string>, bytes, std::vector<std::string>({"4KiB", "64MiB"}),
          "unit sizes, comma-separated (float32; suffixes KiB, MiB, GiB)");
ABSL_FLAG(int32_t, iters, 500,
          "measured operations per rank and variant (units over 1 MiB: a tenth, at least 5)");
ABSL_FLAG(int32_t, warmup, 50,
          "warm-up operations per rank and variant (units over 1 MiB: a tenth, at least 1)");
ABSL_FLAG(std::vector<std::string>, variants,
          std::vector<std::string>({"read", "writeback", "commit"}),
          "operations timed, comma-separated: read (Summon writeback=false + End), writeback "
          "(Summon writeback=true + End), commit (Commit)");
ABSL_FLAG(std::vector<std::string>, with_state_dir, std::vector<std::string>({"off", "on"}),
          "run the daemon without (off) and/or with (on) --state_dir, comma-separated");
ABSL_FLAG(std::string, state_dir_root, "",
          "where the daemon's --state_dir is created (a fresh subdirectory per row, removed at "
          "exit; pick the disk a deployment would use); empty: $TMPDIR");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "extra flatshardd flags, comma-separated (e.g. --state_fsync=false)");
ABSL_FLAG(std::string, flatshardd, FS_BINARY_DIR "/server/flatshardd", "the daemon binary");

namespace flatshard {
namespace {

namespace fs = std::filesystem;
using bench::BenchDaemon;
using bench::Clock;
using bench::ManifestJson;
using bench::MicrosSince;
using bench::Percentile;
using bench::PrintFigure;
using bench::SizeName;

enum class Variant { kRead, kWriteback, kCommit };

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kRead:
      return "read";
    case Variant::kWriteback:
      return "writeback";
    case Variant::kCommit:
      return "commit";
  }
  return "?";
}

absl::StatusOr<std::vector<Variant>> ParseVariants(const std::vector<std::string>& items) {
  std::vector<Variant> out;
  for (const std::string& item : items) {
    bool found = false;
    for (Variant v : {Variant::kRead, Variant::kWriteback, Variant::kCommit}) {
      if (item == VariantName(v)) {
        out.push_back(v);
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("--variants: \"", item, "\" is not one of read, writeback, commit"));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("--variants is empty");
  return out;
}

absl::StatusOr<std::vector<bool>> ParseStateModes(const std::vector<std::string>& items) {
  std::vector<bool> out;
  for (const std::string& item : items) {
    if (item != "off" && item != "on") {
      return absl::InvalidArgumentError(
          absl::StrCat("--with_state_dir: \"", item, "\" is not off or on"));
    }
    out.push_back(item == "on");
  }
  if (out.empty()) return absl::InvalidArgumentError("--with_state_dir is empty");
  return out;
}

// What one rank measured of one variant.
struct RankSamples {
  std::vector<double> summon, end, op;  // op: Summon + End, or Commit
  Clock::time_point start, finish;      // the measured loop
};

struct RowConfig {
  int groups = 1;
  int ranks = 1;
  int64_t numel = 0;
  int iters = 0;
  int warmup = 0;
  std::vector<Variant> variants;
};

// The barrier's completion step: when and how much CPU the daemon had used, at every phase
// (before each variant's warm-up, before its measured loop, and once after the last).
struct PhaseMarks {
  pid_t daemon = -1;
  std::vector<std::pair<Clock::time_point, double>>* marks = nullptr;  // reserved: no allocation
  void operator()() noexcept {
    if (marks->size() < marks->capacity()) {
      marks->emplace_back(Clock::now(), bench::ProcessCpuSeconds(daemon));
    }
  }
};
using Barrier = std::barrier<PhaseMarks>;

// One rank: connect (own socket path), join group g, register, then per variant: barrier,
// warm-up, barrier, the measured loop; a last barrier. `out[v]` gets variant v's samples.
void RankMain(const std::string& address, const RowConfig& cfg, int group, int rank, Barrier* sync,
              std::atomic<bool>* failed, std::vector<RankSamples>* out, absl::Status* status) {
  auto run = [&]() -> absl::Status {
    client::ClientOptions options;
    options.address = address;
    options.call_timeout = absl::Seconds(120);
    options.join_timeout = absl::Seconds(120);
    FS_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c, client::Client::Connect(options));
    FS_RETURN_IF_ERROR(c->Join(absl::StrCat("cg", group), cfg.ranks, rank, "bench"));
    FS_ASSIGN_OR_RETURN(
        client::RegisteredModule model,
        c->Register("", ManifestJson(cfg.numel), bench::kPolicyJson, client::InitMode::kZeros));
    FS_ASSIGN_OR_RETURN(client::ShardViews shards, c->GetShardViews(""));
    if (shards.units().size() != 1 || shards.units()[0].data == nullptr) {
      return absl::InternalError("GetShardViews: want one unit with a mapped shard");
    }
    float* shard = static_cast<float*>(shards.units()[0].data);
    float step = 0;
    for (size_t vi = 0; vi < cfg.variants.size(); ++vi) {
      const Variant variant = cfg.variants[vi];
      RankSamples& s = (*out)[vi];
      client::SummonOptions so;
      so.writeback = variant == Variant::kWriteback;
      auto op = [&](bool record) -> absl::Status {
        if (variant == Variant::kCommit) {
          shard[0] = ++step;
          const auto t0 = Clock::now();
          FS_RETURN_IF_ERROR(c->Commit("").status());
          if (record) s.op.push_back(MicrosSince(t0, Clock::now()));
          return absl::OkStatus();
        }
        const auto t0 = Clock::now();
        FS_ASSIGN_OR_RETURN(std::unique_ptr<client::SummonedParams> p, c->Summon("", "", so));
        const auto t1 = Clock::now();
        const client::ParamView* w = p->Find("weight");
        if (w == nullptr || w->data == nullptr || w->writable != so.writeback) {
          return absl::InternalError(absl::StrCat("Summon(writeback=", so.writeback,
                                                  "): no view \"weight\" of that kind"));
        }
        if (so.writeback) static_cast<float*>(w->data)[0] = ++step;
        const auto t2 = Clock::now();
        FS_RETURN_IF_ERROR(p->End());
        const auto t3 = Clock::now();
        if (record) {
          s.summon.push_back(MicrosSince(t0, t1));
          s.end.push_back(MicrosSince(t2, t3));
          s.op.push_back(MicrosSince(t0, t1) + MicrosSince(t2, t3));
        }
        return absl::OkStatus();
      };
      sync->arrive_and_wait();
      if (failed->load()) return absl::OkStatus();
      for (int i = 0; i < cfg.warmup; ++i) FS_RETURN_IF_ERROR(op(false));
      sync->arrive_and_wait();
      if (failed->load()) return absl::OkStatus();
      s.start = Clock::now();
      for (int i = 0; i < cfg.iters; ++i) FS_RETURN_IF_ERROR(op(true));
      s.finish = Clock::now();
    }
    sync->arrive_and_wait();  // the last variant's CPU mark
    if (failed->load()) return absl::OkStatus();
    (void)model;
    return c->Leave();
  };
  *status = run();
  if (!status->ok()) failed->store(true);
  // Leaving the barrier lets the other ranks pass; they see `failed` and stop. (A rank of the
  // same group waiting in a collective gets UNAVAILABLE when this rank's lease closes.)
  sync->arrive_and_drop();
}

// A row's result for one variant.
struct RowResult {
  int64_t samples = 0;
  double summon_p50 = 0, end_p50 = 0, p50 = 0, p99 = 0;
  double ops_per_s = 0;
  double daemon_cores = -1;  // the daemon's CPU seconds per second over the measured loop
};

struct Row {
  std::vector<RowResult> per_variant;
  std::pair<int64_t, int64_t> retained;  // unlinked daemon segments the clients still map
};

absl::StatusOr<Row> RunRow(const RowConfig& cfg, bool state_dir, const std::string& tag) {
  BenchDaemon daemon;
  const bench::ScopedStopOnSignal stop_on_signal(&daemon);
  std::vector<std::string> flags = absl::GetFlag(FLAGS_daemon_flags);
  if (state_dir) {
    std::string root = absl::GetFlag(FLAGS_state_dir_root);
    if (root.empty()) root = fs::temp_directory_path().string();
    const fs::path dir = fs::path(root) / absl::StrCat(tag, "-state");
    std::error_code ec;
    fs::remove_all(dir, ec);
    daemon.RemoveOnStop(dir);
    flags.push_back("--state_dir=" + dir.string());
  }
  FS_RETURN_IF_ERROR(daemon.Start(absl::GetFlag(FLAGS_flatshardd), tag, flags));
  const int threads = cfg.groups * cfg.ranks;
  // A socket path of its own per client (a symlink in the daemon's directory, removed with it).
  std::vector<std::string> addresses;
  for (int t = 0; t < threads; ++t) {
    const fs::path link = fs::path(daemon.socket()).parent_path() / absl::StrCat("c", t, ".sock");
    std::error_code ec;
    fs::create_symlink(daemon.socket(), link, ec);
    if (ec) return absl::InternalError(absl::StrCat("symlink ", link.string(), ": ", ec.message()));
    addresses.push_back("unix:" + link.string());
  }
  const size_t num_marks = 2 * cfg.variants.size() + 1;
  std::vector<std::pair<Clock::time_point, double>> marks;
  marks.reserve(num_marks + 1);  // + the completion of the phase the ranks leave by dropping
  Barrier sync(threads, PhaseMarks{daemon.pid(), &marks});
  std::atomic<bool> failed{false};
  std::vector<std::vector<RankSamples>> samples(threads,
                                                std::vector<RankSamples>(cfg.variants.size()));
  std::vector<absl::Status> status(threads);
  std::vector<std::thread> pool;
  for (int g = 0; g < cfg.groups; ++g) {
    for (int r = 0; r < cfg.ranks; ++r) {
      const int t = g * cfg.ranks + r;
      pool.emplace_back(RankMain, addresses[t], std::cref(cfg), g, r, &sync, &failed, &samples[t],
                        &status[t]);
    }
  }
  for (std::thread& t : pool) t.join();
  Row row;
  for (int t = 0; t < threads; ++t) {
    if (!status[t].ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a dying daemon: let it go
      const std::string exit_note = daemon.ExitNote();
      return absl::Status(
          status[t].code(),
          absl::StrCat("group ", t / cfg.ranks, " rank ", t % cfg.ranks, ": ", status[t].message(),
                       exit_note.empty() ? "" : "\n-- flatshardd ", exit_note,
                       "\n-- flatshardd log tail:\n", daemon.LogTail()));
    }
  }
  if (marks.size() < num_marks) {
    return absl::InternalError(
        absl::StrCat("the barrier completed ", marks.size(), " phases, want ", num_marks));
  }
  for (size_t vi = 0; vi < cfg.variants.size(); ++vi) {
    std::vector<double> op, summon, end;
    Clock::time_point start = samples[0][vi].start, finish = samples[0][vi].finish;
    for (int t = 0; t < threads; ++t) {
      const RankSamples& s = samples[t][vi];
      op.insert(op.end(), s.op.begin(), s.op.end());
      summon.insert(summon.end(), s.summon.begin(), s.summon.end());
      end.insert(end.end(), s.end.begin(), s.end.end());
      start = std::min(start, s.start);
      finish = std::max(finish, s.finish);
    }
    RowResult r;
    r.samples = static_cast<int64_t>(op.size());
    r.p50 = Percentile(op, 50);
    r.p99 = Percentile(op, 99);
    r.summon_p50 = summon.empty() ? -1 : Percentile(summon, 50);
    r.end_p50 = end.empty() ? -1 : Percentile(end, 50);
    const double wall_us = MicrosSince(start, finish);
    r.ops_per_s = static_cast<double>(op.size()) / (wall_us / 1e6);
    // Between the barrier that started the measured loops and the next one.
    const auto& [t0, cpu0] = marks[2 * vi + 1];
    const auto& [t1, cpu1] = marks[2 * vi + 2];
    if (cpu0 >= 0 && cpu1 >= 0) r.daemon_cores = (cpu1 - cpu0) / (MicrosSince(t0, t1) / 1e6);
    row.per_variant.push_back(r);
  }
  row.retained = bench::RetainedDeletedMappings(daemon.tag());
  daemon.Stop();
  return row;
}

absl::Status Run() {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (ranks < 1 || ranks > 64 || iters < 1 || warmup < 0) {
    return absl::InvalidArgumentError("want --ranks in [1, 64], --iters >= 1, --warmup >= 0");
  }
  FS_ASSIGN_OR_RETURN(
      std::vector<int> groups,
      bench::ParseCounts("groups", absl::GetFlag(FLAGS_groups), 1, 64, "number of groups"));
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  FS_ASSIGN_OR_RETURN(
      std::vector<int64_t> sizes,
      bench::ParseByteSizes("bytes", absl::GetFlag(FLAGS_bytes), 4, int64_t{1} << 40));
  FS_ASSIGN_OR_RETURN(std::vector<Variant> variants, ParseVariants(absl::GetFlag(FLAGS_variants)));
  FS_ASSIGN_OR_RETURN(std::vector<bool> state_modes,
                      ParseStateModes(absl::GetFlag(FLAGS_with_state_dir)));

  std::printf(
      "# flatshard concurrent-groups benchmark: %s; %u hardware threads; load %s; memory "
      "available %" PRId64 " MiB\n",
      absl::GetFlag(FLAGS_flatshardd).c_str(), std::thread::hardware_concurrency(),
      bench::LoadAverage().c_str(), bench::MemAvailableBytes() >> 20);
  std::printf(
      "# G groups x %d rank(s) on one daemon (a fresh daemon per row), each rank a thread with "
      "its own Client and connection; all ranks start each variant behind one barrier. "
      "%d ops per rank after %d warm-up (units over 1 MiB: %d after %d).\n",
      ranks, iters, warmup, bench::ScaledIters(iters, int64_t{1} << 21, 5),
      bench::ScaledIters(warmup, int64_t{1} << 21, 1));
  std::printf(
      "# op: read = Summon(writeback=0)+End, writeback = Summon(writeback=1)+End, commit = "
      "Commit. ops/s: all ranks together. speedup = ops/s(G) / ops/s(G=%d); p50x = p50(G) / "
      "p50(G=%d): independent groups -> speedup ~G (up to the cores), p50x ~1; serialised -> "
      "speedup ~1, p50x ~G. d_cores: the daemon's CPU seconds per second over the measured "
      "loop.\n",
      groups.front(), groups.front());
  std::printf("%-9s %-8s %-10s %3s %8s %10s %10s %10s %10s %11s %8s %6s %8s\n", "#state_dir",
              "size", "op", "G", "samples", "summon50", "end50", "p50(us)", "p99(us)", "ops/s",
              "speedup", "p50x", "d_cores");
  int row_index = 0;
  const std::string tag_base = absl::StrCat("fscgbench", ::getpid());
  for (bool state_dir : state_modes) {
    std::vector<Variant> row_variants;
    for (Variant v : variants) {
      if (state_dir && v == Variant::kRead) continue;  // writes no records: nothing to compare
      row_variants.push_back(v);
    }
    if (row_variants.empty()) continue;
    for (int64_t size : sizes) {
      RowConfig cfg;
      cfg.ranks = ranks;
      cfg.numel = std::max<int64_t>(ranks, size / static_cast<int64_t>(sizeof(float)));
      const int64_t unit_bytes = cfg.numel * static_cast<int64_t>(sizeof(float));
      cfg.iters = bench::ScaledIters(iters, unit_bytes, 5);
      cfg.warmup = bench::ScaledIters(warmup, unit_bytes, 1);
      cfg.variants = row_variants;
      std::vector<RowResult> base;  // per variant, of groups.front()
      for (int g : groups) {
        cfg.groups = g;
        const std::string tag = absl::StrCat(tag_base, "_", row_index++);
        absl::StatusOr<Row> row = RunRow(cfg, state_dir, tag);
        if (!row.ok()) {
          return absl::Status(row.status().code(),
                              absl::StrCat("state_dir=", state_dir ? "on" : "off", " size=",
                                           unit_bytes, " G=", g, ": ", row.status().message()));
        }
        if (base.empty()) base = row->per_variant;
        for (size_t vi = 0; vi < cfg.variants.size(); ++vi) {
          const RowResult& r = row->per_variant[vi];
          const double speedup = r.ops_per_s / base[vi].ops_per_s;
          const double p50x = r.p50 / base[vi].p50;
          auto us = [](double v) { return v < 0 ? std::string("-") : absl::StrFormat("%.1f", v); };
          std::printf("%-9s %-8s %-10s %3d %8" PRId64
                      " %10s %10s %10.1f %10.1f %11.1f %8.2f "
                      "%6.2f %8.2f\n",
                      state_dir ? "on" : "off", SizeName(unit_bytes).c_str(),
                      VariantName(cfg.variants[vi]), g, r.samples, us(r.summon_p50).c_str(),
                      us(r.end_p50).c_str(), r.p50, r.p99, r.ops_per_s, speedup, p50x,
                      r.daemon_cores);
          const std::string figure =
              absl::StrCat(state_dir ? "statedir" : "plain", ".", SizeName(unit_bytes), ".",
                           VariantName(cfg.variants[vi]), ".g", g);
          PrintFigure(figure + ".p50", r.p50, "us");
          PrintFigure(figure + ".ops_per_s", r.ops_per_s, "ops/s", /*lower_is_better=*/false);
          if (g != groups.front()) {
            PrintFigure(figure + ".speedup", speedup, "x", /*lower_is_better=*/false);
            PrintFigure(figure + ".p50x", p50x, "x");
          }
        }
        if (row->retained.first > 0) {
          std::printf("# note: after the row the clients still mapped %" PRId64
                      " unlinked daemon segments (%" PRId64 " MiB)\n",
                      row->retained.first, row->retained.second >> 20);
        }
        std::fflush(stdout);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace flatshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "flatshard concurrent groups on one daemon: Summon+End / writeback End / Commit latency "
      "and throughput with G groups vs 1.\nUsage: flatshard_concurrent_groups_benchmark "
      "[--groups 1,2,4] [--ranks 1] [--bytes 4KiB,64MiB] [--iters N] [--warmup N] "
      "[--variants read,writeback,commit] [--with_state_dir off,on] [--state_dir_root DIR] "
      "[--daemon_flags F1,F2] [--flatshardd PATH]");
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts, so that every thread inherits the mask.
  flatshard::bench::StartSignalThread("flatshard_concurrent_groups_benchmark");
  const absl::Status status = flatshard::Run();
  while (flatshard::bench::Interrupted()) pause();
  if (!status.ok()) {
    std::fprintf(stderr, "flatshard_concurrent_groups_benchmark: FAILED: %s\n",
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
