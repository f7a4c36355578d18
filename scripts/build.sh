#!/usr/bin/env bash
# Configures and builds flatshard (Release, -j2) into ${FS_BUILD_DIR:-build}.
# Extra arguments go to cmake's configure step (e.g. -DFS_WITH_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FS_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${FS_BUILD_TYPE:-Release} "$@"
cmake --build "$BUILD_DIR" -j "${FS_JOBS:-2}"
