#!/usr/bin/env bash
# Fuzzes the JSON readers and the planner (tests/fuzz/planner_fuzzer.cc) with libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   scripts/fuzz.sh [SECONDS] [--merge] [--build-only] [-- LIBFUZZER_FLAGS...]
#
# Builds build-fuzz/planner_fuzzer with clang++ (incremental, -j2) from the common/ sources it
# needs, then fuzzes for SECONDS (default 60). New inputs go to build-fuzz/corpus (the
# checked-in tests/fuzz/corpus is read, never written, unless --merge). Crashes, leaks,
# timeouts and inputs slower than FS_FUZZ_SLOW_S seconds (default 1) are saved under
# tests/fuzz/crashes/ (gitignored) and make the script fail.
#
#   --merge       afterwards, add the new inputs that reach new coverage to tests/fuzz/corpus
#                 (libFuzzer -merge=1: only coverage-increasing files, named by SHA-1).
#   --build-only  just build build-fuzz/planner_fuzzer (e.g. to run it on one FILE).
#
# Environment: CXX_FUZZ (default clang++), FS_FUZZ_JOBS (parallel fuzzing processes, default
# 1), FS_FUZZ_SLOW_S, FS_FUZZ_TIMEOUT_S (per input hard limit, default 10).
# Exit status: 0 clean; 1 a finding or a build error; 77 when clang++ or libFuzzer is
# missing (CTest's SKIP_RETURN_CODE).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=60
MERGE=0
BUILD_ONLY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --merge) MERGE=1 ;;
    --build-only) BUILD_ONLY=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    ''|*[!0-9]*|0) echo "usage: $0 [SECONDS>0] [--merge] [--build-only] [-- LIBFUZZER_FLAGS...]" >&2
                   exit 2 ;;
    *) SECS=$1 ;;
  esac
  shift
done

CXX_FUZZ=${CXX_FUZZ:-clang++}
OUT=build-fuzz
CRASHES=tests/fuzz/crashes
SEEDS=tests/fuzz/corpus
WORK=$OUT/corpus
SLOW_S=${FS_FUZZ_SLOW_S:-1}
TIMEOUT_S=${FS_FUZZ_TIMEOUT_S:-10}
JOBS=${FS_FUZZ_JOBS:-1}

if ! command -v "$CXX_FUZZ" >/dev/null 2>&1; then
  echo "fuzz: $CXX_FUZZ not found; skipping (install clang and libclang-rt-14-dev)" >&2
  exit 77
fi
mkdir -p "$OUT" "$WORK" "$CRASHES"
# libFuzzer ships separately from clang on Debian (libclang-rt-*-dev).
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    "$CXX_FUZZ" -x c++ -fsanitize=fuzzer - -o "$OUT/probe" >/dev/null 2>&1; then
  echo "fuzz: $CXX_FUZZ cannot link -fsanitize=fuzzer; skipping (install libclang-rt-14-dev)" >&2
  exit 77
fi

# The common/ sources the JSON readers and the planner need (no protobuf, no gRPC).
COMMON_SRCS=$(sed -n 's|^common/\(.*\.cc\)$|\1|p' tests/fuzz/common_sources.txt | tr '\n' ' ')
# libcrypto: common/sha256.cc hashes with OpenSSL.
ABSL_PKGS="absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map absl_span absl_time libcrypto"
if ! ABSL_CFLAGS=$(pkg-config --cflags $ABSL_PKGS) || ! ABSL_LIBS=$(pkg-config --libs $ABSL_PKGS); then
  echo "fuzz: pkg-config cannot find abseil or libcrypto ($ABSL_PKGS)" >&2
  exit 1
fi

# A generated Makefile: incremental rebuilds with header dependencies (-MMD), two jobs.
cat > "$OUT/Makefile" <<MAKE
CXX := $CXX_FUZZ
SRC := $PWD
SAN := -fsanitize=address,undefined -fno-sanitize-recover=all
CXXFLAGS := -std=c++20 -O1 -g -fno-omit-frame-pointer -Wall -Wextra \$(SAN) -I\$(SRC) $ABSL_CFLAGS
OBJS := $(for s in $COMMON_SRCS; do printf 'obj/%s ' "${s%.cc}.o"; done) obj/planner_fuzzer.o

planner_fuzzer: \$(OBJS)
	\$(CXX) -fsanitize=fuzzer \$(SAN) -o \$@ \$(OBJS) $ABSL_LIBS

obj/%.o: \$(SRC)/common/%.cc
	@mkdir -p obj
	\$(CXX) \$(CXXFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c \$< -o \$@

obj/planner_fuzzer.o: \$(SRC)/tests/fuzz/planner_fuzzer.cc
	@mkdir -p obj
	\$(CXX) \$(CXXFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c \$< -o \$@

-include \$(wildcard obj/*.d)
MAKE
echo "fuzz: building $OUT/planner_fuzzer"
make -s -C "$OUT" -j2 planner_fuzzer
if [ $BUILD_ONLY -eq 1 ]; then
  echo "fuzz: built $OUT/planner_fuzzer"
  exit 0
fi

export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
stamp=$(mktemp "$OUT/stamp.XXXXXX")
FLAGS=(
  -max_total_time="$SECS"
  -timeout="$TIMEOUT_S"
  -report_slow_units="$SLOW_S"
  -rss_limit_mb=2048
  -dict=tests/fuzz/planner_fuzzer.dict
  -artifact_prefix="$CRASHES/"
  -print_final_stats=1
)
if [ "$JOBS" -gt 1 ]; then FLAGS+=(-fork="$JOBS"); fi
echo "fuzz: running for ${SECS}s over $SEEDS (new inputs in $WORK, findings in $CRASHES)"
set +e
"$OUT/planner_fuzzer" "${FLAGS[@]}" "${EXTRA[@]}" "$WORK" "$SEEDS"
rc=$?
set -e

findings=$(find "$CRASHES" -maxdepth 1 -type f -newer "$stamp" | sort)
rm -f "$stamp"
if [ $rc -ne 0 ] || [ -n "$findings" ]; then
  echo "fuzz: FAILED (libFuzzer exit $rc); reproduce with: $OUT/planner_fuzzer FILE" >&2
  [ -n "$findings" ] && printf '  %s\n' $findings >&2
  exit 1
fi

if [ $MERGE -eq 1 ]; then
  echo "fuzz: merging coverage-increasing inputs of $WORK into $SEEDS"
  "$OUT/planner_fuzzer" -merge=1 -timeout="$TIMEOUT_S" -rss_limit_mb=2048 \
    -artifact_prefix="$CRASHES/" "$SEEDS" "$WORK"
  echo "fuzz: $SEEDS now holds $(find "$SEEDS" -type f | wc -l) files, $(du -sh "$SEEDS" | cut -f1)"
fi
echo "fuzz: OK"
