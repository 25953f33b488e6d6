#!/usr/bin/env bash
# Installs what oscarkv needs on Debian 12 / Ubuntu (only the missing
# packages, with apt-get) and builds it into ./build (Release, Ninja).
# The CUDA backend is built too when /usr/local/cuda/bin/nvcc exists.
#   deploy/local/setup.sh            # install + configure + build everything
#   OSCARKV_BUILD_DIR=out deploy/local/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

packages=(cmake ninja-build g++ pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler grpc-proto libabsl-dev prometheus-cpp-dev googletest libgtest-dev libgmock-dev
  libeigen3-dev nlohmann-json3-dev ccache python3)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "oscarkv setup: installing ${missing[*]}" >&2
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build=${OSCARKV_BUILD_DIR:-build}
jobs=$(nproc)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${OSCARKV_CMAKE_ARGS:-} >/dev/null
echo "oscarkv setup: building in $build with $jobs jobs (first build takes a few minutes)" >&2
ninja -C "$build" -j "$jobs"
