#!/usr/bin/env bash
# README command 1: installs what is missing, builds, and runs the main job.
#
#   scripts/run_demo.sh [--ranks N] [--steps N] [--precision fp32|bf16] [--no-build]
#                       [--build-dir DIR]
#
# Trains a small GPT (tied embeddings, 3 blocks; examples/python/gpt.py) with PyTorch on
# flatshard, FSDP-style (flatshard.torch.FlatShardModule, FULL_SHARD, one unit per Block):
# 1. starts a local flatshardd (host memory, no GPU) on a socket in a fresh temporary
#    directory, with its own shared-memory segment prefix;
# 2. runs N rank processes (default 3), each a trainer whose parameters, gradients and shards
#    live in the daemon; AdamW steps the shards in place;
# 3. prints the loss of every step next to a single-process reference trained on the same
#    global batches, and checks they agree to float32 round-off (and the final weights too);
# 4. uses summon_full_params to read a weight, then edits it on rank 0 only
#    (rank0_only + writeback: beyond FSDP) and checks every rank sees the edit;
# 5. stops the daemon with SIGTERM and checks that it exited 0 and left no segments.
# Exit status 0 only when all of that passed.
#
# --precision bf16 trains with FSDP's MixedPrecision(param_dtype=bfloat16,
# reduce_dtype=float32) (the daemon casts the shards for the all-gathers; shards and AdamW
# stay float32) against a reference with the same casts, within run_gpt.py's stated bound
# (MIXED_PRECISION_NOTE) instead of float32 round-off. Default fp32.
#
# --no-build skips setup.sh and build.sh and uses the binaries and the Python package in
# --build-dir (default ${FS_BUILD_DIR:-build}); CTest's example_trainer_smoke runs it that way.
set -euo pipefail
cd "$(dirname "$0")/.."

RANKS=3
STEPS=50
PRECISION=fp32
BUILD=1
BUILD_DIR=${FS_BUILD_DIR:-build}
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS=${2:?--ranks needs a number}; shift ;;
    --steps) STEPS=${2:?--steps needs a number}; shift ;;
    --precision) PRECISION=${2:?--precision needs fp32 or bf16}; shift ;;
    --no-build) BUILD=0 ;;
    --build-dir) BUILD_DIR=${2:?--build-dir needs a directory}; shift ;;
    *) echo "usage: $0 [--ranks N] [--steps N] [--precision fp32|bf16] [--no-build] [--build-dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
case "$RANKS" in ''|*[!0-9]*|0) echo "run_demo: --ranks wants a positive number" >&2; exit 2 ;; esac
case "$STEPS" in ''|*[!0-9]*|0) echo "run_demo: --steps wants a positive number" >&2; exit 2 ;; esac
case "$PRECISION" in fp32|bf16) ;; *) echo "run_demo: --precision must be fp32 or bf16" >&2; exit 2 ;; esac
case "$RANKS" in 1|2|3|4|6|12) ;; *) echo "run_demo: --ranks must divide the global batch of 12 (1, 2, 3, 4, 6 or 12)" >&2; exit 2 ;; esac

if [ $BUILD -eq 1 ]; then
  bash scripts/setup.sh
  FS_BUILD_DIR=$BUILD_DIR bash scripts/build.sh > /dev/null
fi
DAEMON=$BUILD_DIR/server/flatshardd
[ -x "$DAEMON" ] || { echo "run_demo: $DAEMON is missing (build first)" >&2; exit 1; }
[ -d "$BUILD_DIR/python/flatshard" ] || {
  echo "run_demo: $BUILD_DIR/python/flatshard is missing (build first)" >&2; exit 1; }

export PYTHONPATH="$(cd "$BUILD_DIR" && pwd)/python${PYTHONPATH:+:$PYTHONPATH}"
export FLATSHARD_DAEMON="$(cd "$(dirname "$DAEMON")" && pwd)/flatshardd"
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 examples/python/run_gpt.py --ranks "$RANKS" --steps "$STEPS" \
  --precision "$PRECISION" --demo
