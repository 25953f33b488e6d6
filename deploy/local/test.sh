#!/usr/bin/env bash
# Sets up (deploy/local/setup.sh) and runs the whole test suite with ctest.
# GPU tests (label `gpu`) skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/setup.sh
build=${OSCARKV_BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure -j "$(nproc)" --timeout 600
