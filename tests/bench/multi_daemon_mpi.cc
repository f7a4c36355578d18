#include "tests/bench/multi_daemon_mpi.h"

#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "tests/bench/bench_support.h"
#include "tests/bench/emulated_nodes.h"
#include "tests/bench/multi_daemon_processes.h"

namespace flatshard::bench::md {

namespace fs = std::filesystem;

// `ompi_info`'s btl_vader_single_copy_mechanism ("" when unknown).
std::string VaderSingleCopy(const fs::path& dir) {
  const std::string log = (dir / "ompi_info.log").string();
  absl::StatusOr<pid_t> pid =
      SpawnTool({"ompi_info", "--param", "btl", "vader", "--level", "3"}, {}, log);
  if (!pid.ok()) return "";
  absl::StatusOr<int> st = WaitTool(*pid, absl::Now() + absl::Seconds(30), "ompi_info");
  if (!st.ok()) return "";
  for (absl::string_view line : absl::StrSplit(bench::ReadText(log), '\n')) {
    if (!absl::StrContains(line, "btl_vader_single_copy_mechanism")) continue;
    const size_t at = line.find("current value: \"");
    if (at == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(at + 16);
    return std::string(rest.substr(0, rest.find('"')));
  }
  return "";
}

absl::StatusOr<MpiResult> RunMpi(const std::string& mpirun, const std::string& baseline, int np,
                                 int64_t bytes, int iters, int warmup, const fs::path& dir,
                                 absl::Duration timeout, const std::string& op, int rpn,
                                 const testing::EmulatedLinks* links) {
  if (mpirun.empty() || !FindInPath(mpirun) || baseline.empty() ||
      ::access(baseline.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no MPI baseline (mpirun \"", mpirun, "\", baseline \"", baseline,
                     "\"): install libopenmpi-dev and build flatshard_mpi_allgather_baseline"));
  }
  std::vector<std::string> launch = {mpirun};
  if (links != nullptr) {
    FS_ASSIGN_OR_RETURN(launch, bench::MpiOverLinks(mpirun, rpn, *links, dir));
  }
  // A session directory of this run's own: two runs sharing /tmp/ompi.<host>.<uid> clash
  // ("File exists", exit 213). Over links every node has its own (bench::MpiOverLinks).
  const fs::path session = dir / "ompi";
  if (links == nullptr) {
    std::error_code ec;
    fs::create_directories(session, ec);
    launch.insert(launch.end(), {"--mca", "orte_tmpdir_base", session.string()});
  }
  launch.push_back("--oversubscribe");
  if (::geteuid() == 0) launch.push_back("--allow-run-as-root");
  launch.insert(launch.end(), {"-np", absl::StrCat(np)});
  // Which PML and BTL carry the bytes: a tiny probe run with verbose selection output (the same
  // per-peer choice as the timed run, which runs without the verbosity).
  std::vector<std::string> probe = launch;
  probe.insert(probe.end(),
               {"--mca", "pml_base_verbose", "10", "--mca", "btl_base_verbose", "100", baseline,
                absl::StrCat("--bytes=", 4096 * np), "--iters=1", "--warmup=0", "--op=" + op});
  std::vector<std::string> timed = launch;
  timed.insert(timed.end(),
               {baseline, absl::StrCat("--bytes=", bytes), absl::StrCat("--iters=", iters),
                absl::StrCat("--warmup=", warmup), "--op=" + op});
  const absl::Time deadline = absl::Now() + timeout;
  auto run = [&](const std::vector<std::string>& argv,
                 absl::string_view name) -> absl::StatusOr<std::string> {
    const std::string log = (dir / absl::StrCat("mpi_", op, "_np", np, "_", name, ".log")).string();
    FS_ASSIGN_OR_RETURN(pid_t pid, SpawnTool(argv, {}, log));
    FS_ASSIGN_OR_RETURN(int status, WaitTool(pid, deadline, "mpirun"));
    std::string out = bench::ReadText(log);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), ": ",
                                              bench::DescribeWaitStatus(status), "; output:\n",
                                              bench::Tail(out, 3000)));
    }
    return out;
  };
  FS_ASSIGN_OR_RETURN(const std::string probe_out, run(probe, "probe"));
  FS_ASSIGN_OR_RETURN(const std::string out, run(timed, "timed"));
  MpiResult r;
  std::set<std::string> pmls, btls;
  for (absl::string_view line : absl::StrSplit(probe_out, '\n')) {
    // "[host:pid] select: component ob1 selected"
    if (size_t at = line.find("select: component ");
        at != absl::string_view::npos && absl::EndsWith(line, " selected")) {
      absl::string_view rest = line.substr(at + 18);
      pmls.insert(std::string(rest.substr(0, rest.find(' '))));
    }
    // "[host:pid] mca: bml: Using vader btl for send to [[...],1] on node host"
    if (size_t at = line.find("bml: Using "); at != absl::string_view::npos) {
      absl::string_view rest = line.substr(at + 11);
      std::string btl(rest.substr(0, rest.find(' ')));
      if (btl != "self") btls.insert(btl);  // self: a rank to itself
    }
  }
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::StartsWith(line, absl::StrCat("mpi_", op, " "))) continue;
    for (absl::string_view kv : absl::StrSplit(line, ' ')) {
      if (absl::ConsumePrefix(&kv, "median_s=")) {
        if (!absl::SimpleAtod(kv, &r.median_s)) r.median_s = 0;
      } else if (absl::ConsumePrefix(&kv, "bytes=")) {
        if (!absl::SimpleAtoi(kv, &r.bytes)) r.bytes = 0;
      }
    }
  }
  if (r.median_s <= 0) {
    return absl::InternalError(
        absl::StrCat("no median_s in the MPI baseline's output:\n", bench::Tail(out, 3000)));
  }
  r.pml = pmls.empty() ? "?" : absl::StrJoin(pmls, "+");
  r.btl = btls.empty() ? "?" : absl::StrJoin(btls, "+");
  r.single_copy = VaderSingleCopy(dir);
  return r;
}

}  // namespace flatshard::bench::md
