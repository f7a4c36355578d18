#!/usr/bin/env bash
# A/B benchmark of two flatshardd builds: the same benchmark binaries (same client code) run
# against a "before" and an "after" daemon, alternated before/after, after/before, ... for N
# rounds in one session on one machine; every headline figure ("# FIGURE" lines the benchmarks
# print) is collected and compared by its median over the rounds.
#
# Usage:
#   scripts/bench_ab.sh BEFORE_FLATSHARDD AFTER_FLATSHARDD [--rounds N] [--quick] [--json]
#                       [--only daemon,multi,groups] [--out DIR]
#
#   --rounds N   rounds (default 3); each round runs every benchmark once per daemon, the order
#                of the two daemons flipping every round (ABBA...).
#   --quick      small sizes and few iterations (a smoke test of the whole pipeline, minutes).
#   --json       print the result as JSON instead of the table.
#   --only LIST  a subset of: daemon (flatshard_daemon_benchmark: Summon+End latency of a 4 KiB
#                unit, 1 GiB unshard with 2 and 4 local ranks incl. writeback End, Commit and
#                writeback End of 4 KiB and 64 MiB units with and without --state_dir), multi
#                (flatshard_multi_daemon_benchmark: 1 GiB all-gather over 2 daemons; its MPI and
#                ucx_perftest baselines do not depend on the daemon and are skipped), groups
#                (flatshard_concurrent_groups_benchmark: 1, 2 and 4 groups summoning and
#                committing concurrently on one daemon).
#   --out DIR    where logs and results go (default: ${TMPDIR:-/tmp}/bench_ab.<date>.<pid>).
#
# Environment: FS_BUILD_DIR (default build, relative to the repository root) holds the benchmark
# binaries (tests/bench/...); FS_AB_ARGS_DAEMON, FS_AB_ARGS_MULTI, FS_AB_ARGS_GROUPS replace a
# benchmark's arguments (besides --flatshardd).
#
# Output (stdout, and table.txt / results.json / figures.tsv / logs in --out): one line per figure
#   figure unit better n before_median after_median ratio worse% noise% verdict
# ratio = after/before (> 1 is slower for latencies, better for "higher" figures such as ops/s
# and speedup); worse% = how much worse the after median is, whichever way is better (negative:
# improved); noise% = the larger relative range (max-min)/median of the two sides' rounds;
# verdict: WORSE when every after round is worse than every before round and worse% > 5,
# BETTER likewise, else "~" (within noise); "context:..." for baselines that do not measure the
# daemon's work (memcpy, Ping): they show how noisy the machine was. With few rounds on a busy
# machine some figures pass the WORSE test by chance (even with the same binary on both sides:
# the --quick smoke; a "?" marks verdicts from fewer than 3 rounds a side): rerun those with
# more rounds (--only, FS_AB_ARGS_*) on an idle machine.
# Commit with --state_dir is dominated by the disk's fsync latency ($TMPDIR's disk; the
# benchmarks' --state_dir_root picks another). Exits 1 if a benchmark run failed (its figures are
# missing; the others are still compared), 0 otherwise. Needs no root (the benchmarks use
# /dev/shm and $TMPDIR only); bash, awk, coreutils.
#
# Reproduce the issue-21 comparison. The "before" daemon is a build of main before the refactor
# (this branch's build of it: its flatshardd links the project statically and needs only system
# libraries and /usr/local/cuda, so it keeps working while other trees rebuild); the benchmark
# binaries come from that same build (FS_BUILD_DIR), so both daemons serve the same client code:
#   git worktree add ../before <commit before the change> && (cd ../before && bash scripts/build.sh)
#   cp ../before/build/server/flatshardd /tmp/flatshardd.before   # a copy nothing rebuilds
#   bash scripts/build.sh                            # this tree: the "after" daemon
#   FS_BUILD_DIR=build scripts/bench_ab.sh /tmp/flatshardd.before build/server/flatshardd \
#       --rounds 3 --out /tmp/ab21
# on an otherwise idle machine (no builds or tests running: they are the main noise).
# Smoke test (both sides the same binary, ratios ~1):
#   scripts/bench_ab.sh build/server/flatshardd build/server/flatshardd --quick --rounds 2
set -uo pipefail

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=3
QUICK=0
JSON=0
ONLY="daemon,multi,groups"
OUT=""
POSITIONAL=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=${2:?--rounds needs a value}; shift 2 ;;
    --rounds=*) ROUNDS=${1#*=}; shift ;;
    --quick) QUICK=1; shift ;;
    --json) JSON=1; shift ;;
    --only) ONLY=${2:?--only needs a value}; shift 2 ;;
    --only=*) ONLY=${1#*=}; shift ;;
    --out) OUT=${2:?--out needs a value}; shift 2 ;;
    --out=*) OUT=${1#*=}; shift ;;
    -h|--help) usage ;;
    -*) echo "bench_ab.sh: unknown option $1" >&2; usage ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done
[ ${#POSITIONAL[@]} -eq 2 ] || usage
case "$ROUNDS" in ''|*[!0-9]*|0) echo "bench_ab.sh: --rounds wants a positive integer" >&2; exit 2 ;; esac

abspath() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
BEFORE=$(abspath "${POSITIONAL[0]}") || { echo "bench_ab.sh: no such file: ${POSITIONAL[0]}" >&2; exit 2; }
AFTER=$(abspath "${POSITIONAL[1]}") || { echo "bench_ab.sh: no such file: ${POSITIONAL[1]}" >&2; exit 2; }
for bin in "$BEFORE" "$AFTER"; do
  [ -x "$bin" ] || { echo "bench_ab.sh: $bin is not an executable" >&2; exit 2; }
done

BUILD_DIR=${FS_BUILD_DIR:-build}
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac
BENCH_DIR="$BUILD_DIR/tests/bench"

if [ "$QUICK" = 1 ]; then
  ARGS_DAEMON="--bytes 8388608 --world_sizes 2 --iters 200 --warmup 20 --reps 2 --commit_bytes 4KiB,1MiB --commit_iters 30"
  ARGS_MULTI="--bytes 8388608 --daemons 2 --iters 3 --warmup 1 --skip_mpi --skip_ucx_perftest --skip_transfer"
  ARGS_GROUPS="--groups 1,2 --bytes 4KiB,1MiB --iters 50 --warmup 5"
else
  ARGS_DAEMON="--bytes 1073741824 --world_sizes 2,4"
  ARGS_MULTI="--bytes 1073741824 --daemons 2 --skip_mpi --skip_ucx_perftest --skip_transfer"
  ARGS_GROUPS="--groups 1,2,4"
fi
ARGS_DAEMON=${FS_AB_ARGS_DAEMON:-$ARGS_DAEMON}
ARGS_MULTI=${FS_AB_ARGS_MULTI:-$ARGS_MULTI}
ARGS_GROUPS=${FS_AB_ARGS_GROUPS:-$ARGS_GROUPS}

declare -A BIN=([daemon]=flatshard_daemon_benchmark [multi]=flatshard_multi_daemon_benchmark
                [groups]=flatshard_concurrent_groups_benchmark)
declare -A ARGS=([daemon]="$ARGS_DAEMON" [multi]="$ARGS_MULTI" [groups]="$ARGS_GROUPS")
BENCHES=()
IFS=',' read -r -a SELECTED <<<"$ONLY"
for b in "${SELECTED[@]}"; do
  [ -n "${BIN[$b]:-}" ] || { echo "bench_ab.sh: --only: unknown benchmark '$b' (daemon, multi, groups)" >&2; exit 2; }
  [ -x "$BENCH_DIR/${BIN[$b]}" ] || {
    echo "bench_ab.sh: $BENCH_DIR/${BIN[$b]} is missing; build it:" >&2
    echo "  cmake --build $BUILD_DIR -j2 --target ${BIN[$b]}" >&2
    exit 2
  }
  BENCHES+=("$b")
done

OUT=${OUT:-${TMPDIR:-/tmp}/bench_ab.$(date +%Y%m%d-%H%M%S).$$}
mkdir -p "$OUT" || exit 2
FIGURES="$OUT/figures.tsv"
: >"$FIGURES"

{
  echo "# bench_ab: $(date -Is) on $(hostname), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# before: $BEFORE ($(sha256sum "$BEFORE" | cut -c1-12), $(date -r "$BEFORE" -Is))"
  echo "# after:  $AFTER ($(sha256sum "$AFTER" | cut -c1-12), $(date -r "$AFTER" -Is))"
  echo "# benchmarks: $BENCH_DIR; rounds $ROUNDS (order flips every round); quick=$QUICK; logs: $OUT"
  for b in "${BENCHES[@]}"; do echo "# $b: ${BIN[$b]} ${ARGS[$b]}"; done
} | tee "$OUT/header.txt" >&2

failures=0
for ((round = 1; round <= ROUNDS; round++)); do
  for b in "${BENCHES[@]}"; do
    if ((round % 2 == 1)); then sides=(before after); else sides=(after before); fi
    for side in "${sides[@]}"; do
      if [ "$side" = before ]; then daemon=$BEFORE; else daemon=$AFTER; fi
      log="$OUT/$b.$side.r$round.log"
      start=$(date +%s)
      # shellcheck disable=SC2086  # ARGS are whitespace-separated flags
      "$BENCH_DIR/${BIN[$b]}" ${ARGS[$b]} --flatshardd="$daemon" >"$log" 2>&1
      rc=$?
      echo "# round $round $b $side: exit $rc, $(($(date +%s) - start)) s ($log)" >&2
      if [ $rc -ne 0 ]; then
        failures=$((failures + 1))
        tail -n 5 "$log" | sed 's/^/#   /' >&2
        continue
      fi
      awk -v side="$side" -v round="$round" -v bench="$b" \
        '$1 == "#" && $2 == "FIGURE" && NF >= 6 && $4 ~ /^[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$/ { print side "\t" round "\t" bench "." $3 "\t" $4 "\t" $5 "\t" $6 "\t" ($7 == "context" ? "context" : "") }' \
        "$log" >>"$FIGURES"
    done
  done
done

# One row per figure, in the order the figures first appeared.
summarise() {
  awk -F'\t' -v json="$1" '
    function median(list,    n, a, i, j, t) {
      n = split(list, a, " ")
      for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
      if (n == 0) return ""
      return (n % 2) ? a[(n + 1) / 2] + 0 : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    function commas(list,    n, a, i, out) {
      n = split(list, a, " "); out = ""
      for (i = 1; i <= n; i++) out = out (i > 1 ? ", " : "") a[i]
      return out
    }
    function minmax(list, want_max,    n, a, i, m) {
      n = split(list, a, " "); m = a[1] + 0
      for (i = 2; i <= n; i++) if (want_max ? a[i] + 0 > m : a[i] + 0 < m) m = a[i] + 0
      return m
    }
    {
      key = $3
      if (!(key in seen)) { seen[key] = 1; order[++count] = key; unit[key] = $5; better[key] = $6; context[key] = ($7 == "context") }
      if ($1 == "before") { b[key] = b[key] " " $4; nb[key]++ } else { a[key] = a[key] " " $4; na[key]++ }
    }
    END {
      if (json) printf "[\n"
      else printf "%-52s %-6s %-6s %5s %12s %12s %7s %7s %7s %s\n", "#figure", "unit", "better", "n", "before", "after", "ratio", "worse%", "noise%", "verdict"
      for (i = 1; i <= count; i++) {
        k = order[i]
        mb = (nb[k] ? median(b[k]) : ""); ma = (na[k] ? median(a[k]) : "")
        ratio = ""; worse = ""; noise = ""; verdict = "missing"
        if (mb != "" && ma != "") {
          ratio = (mb != 0) ? ma / mb : 0
          lower = (better[k] == "lower")
          if (mb != 0 && ma != 0) worse = lower ? (ma / mb - 1) * 100 : (mb / ma - 1) * 100
          else worse = 0
          nsb = (mb != 0) ? (minmax(b[k], 1) - minmax(b[k], 0)) / mb * 100 : 0
          nsa = (ma != 0) ? (minmax(a[k], 1) - minmax(a[k], 0)) / ma * 100 : 0
          noise = (nsb > nsa) ? nsb : nsa
          verdict = "~"
          if (lower) { all_worse = minmax(a[k], 0) > minmax(b[k], 1); all_better = minmax(a[k], 1) < minmax(b[k], 0) }
          else { all_worse = minmax(a[k], 1) < minmax(b[k], 0); all_better = minmax(a[k], 0) > minmax(b[k], 1) }
          if (all_worse && worse > 5) verdict = "WORSE"
          else if (all_better && worse < -5) verdict = "BETTER"
          if (context[k]) verdict = "context:" verdict
        }
        n = (nb[k] < na[k]) ? nb[k] : na[k]
        if (verdict != "missing" && n < 3) verdict = verdict "?"
        if (json) {
          printf "  {\"figure\": \"%s\", \"unit\": \"%s\", \"better\": \"%s\", \"rounds\": %d, ", k, unit[k], better[k], n
          printf "\"before\": [%s], \"after\": [%s], ", commas(b[k]), commas(a[k])
          printf "\"before_median\": %s, \"after_median\": %s, \"ratio\": %s, \"worse_pct\": %s, \"noise_pct\": %s, \"verdict\": \"%s\"}%s\n", mb == "" ? "null" : mb, ma == "" ? "null" : ma, ratio == "" ? "null" : sprintf("%.4f", ratio), worse == "" ? "null" : sprintf("%.2f", worse), noise == "" ? "null" : sprintf("%.2f", noise), verdict, i < count ? "," : ""
        } else {
          printf "%-52s %-6s %-6s %5d %12s %12s %7s %7s %7s %s\n", k, unit[k], better[k], n, mb == "" ? "-" : sprintf("%.6g", mb), ma == "" ? "-" : sprintf("%.6g", ma), ratio == "" ? "-" : sprintf("%.3f", ratio), worse == "" ? "-" : sprintf("%+.1f", worse), noise == "" ? "-" : sprintf("%.1f", noise), verdict
        }
      }
      if (json) printf "]\n"
    }' "$FIGURES"
}

summarise 0 >"$OUT/table.txt"
summarise 1 >"$OUT/results.json"
if [ "$JSON" = 1 ]; then cat "$OUT/results.json"; else cat "$OUT/table.txt"; fi
echo "# results: $OUT/table.txt $OUT/results.json; $failures failed run(s)" >&2
[ "$failures" -eq 0 ]
