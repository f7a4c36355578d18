#!/usr/bin/env bash
# Installs the Debian 12 packages flatshard needs to build and test. Idempotent.
# CUDA and NCCL are optional and come from /usr/local/cuda when the machine has them.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libucx-dev nlohmann-json3-dev
  libssl-dev   # libcrypto: SHA-256 (common/sha256.cc)
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev   # libFuzzer for the JSON reader's fuzz target
  clang-format   # scripts/check_format.sh (.clang-format)
  ucx-utils openmpi-bin libopenmpi-dev   # baselines: ucx_perftest, MPI_Allgather
  iproute2   # emulated nodes (tests/testing/emulated_links.h): ip netns, veth, bridge, tc
  python3 python3-yaml systemd   # tests/deploy: manifests' checks, systemd-analyze verify
  patchelf   # scripts/package.sh: RPATH $ORIGIN/../lib on the bundled binaries
  lintian   # tests/package/deb_test.sh: no lintian error on the .debs
  python3-dev pybind11-dev python3-numpy python3-torch python3-torchvision python3-pytest  # the flatshard Python package
  python3-venv mypy   # the wheel installed into a venv (tests/python/wheel), the type hints checked
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
