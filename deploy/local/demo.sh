#!/usr/bin/env bash
# Sets up (deploy/local/setup.sh) and runs the main job: the codec demo on the
# embedded CPU backend (a synthetic Qwen3-8B-shaped layer compressed and attended).
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/setup.sh
build=${OSCARKV_BUILD_DIR:-build}
"$build"/tests/bench/oscarkv-codec-demo "$@"
