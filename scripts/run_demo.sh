#!/usr/bin/env bash
# README command 1: installs what is missing, builds, and runs the main job.
# Until the daemon lands, the main job plans the example GPT (tied embeddings) for 4 ranks:
# the table first, then the plan JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh > /dev/null
CTL=${FS_BUILD_DIR:-build}/client/flatshardctl
M=examples/models/gpt_tied.manifest.json
P=examples/models/gpt_tied.policy.json
echo "\$ flatshardctl plan --manifest $M --policy $P --world-size 4 --format table"
"$CTL" plan --manifest "$M" --policy "$P" --world-size 4 --format table
echo
echo "\$ flatshardctl plan --manifest $M --policy $P --world-size 4"
"$CTL" plan --manifest "$M" --policy "$P" --world-size 4
