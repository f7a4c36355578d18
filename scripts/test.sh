#!/usr/bin/env bash
# README command 2: installs what is missing, builds, and runs the whole default test suite.
# GPU tests (label gpu) and benchmarks/soaks (labels bench, soak) are excluded.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_format.sh   # changed C++ files follow .clang-format
bash scripts/build.sh
BUILD_DIR=${FS_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${FS_JOBS:-2}" -LE 'gpu|bench|soak' \
  --timeout 600
