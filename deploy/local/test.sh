#!/usr/bin/env bash
# Sets up (deploy/local/setup.sh) and runs the whole test suite with ctest.
# GPU tests (label `gpu`) skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/setup.sh
# promtool (Debian package prometheus, ~330 MB) lets the metrics test check the
# exposition format; without it that one test skips and says so.
if ! command -v promtool >/dev/null 2>&1; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "oscarkv test: installing prometheus for promtool" >&2
  $sudo apt-get update -qq >/dev/null || true
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus \
    >/dev/null || echo "oscarkv test: could not install prometheus; the promtool test will skip" >&2
fi
build=${OSCARKV_BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure -j "$(nproc)" --timeout 600
