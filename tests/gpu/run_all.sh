#!/bin/bash
# Runs every GPU test and benchmark in one go on the GPU host and writes logs
# and JSON to OUT_DIR; prints a short table last.
#
#   tests/gpu/run_all.sh OUT_DIR [BUNDLE_DIR]
#
# Build and bundle on the dev machine first (no GPU needed there):
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DOSCARKV_NATIVE=OFF \
#         -DCMAKE_CUDA_ARCHITECTURES=90
#   ninja -C build-cuda cuda_codec_test cuda_attend_test oscarkv_gpu_bench
#   /work/shared/tools/gpu-bundle .gpu build-cuda/tests/gpu/cuda_codec_test \
#       build-cuda/tests/gpu/cuda_attend_test build-cuda/tests/gpu/oscarkv_gpu_bench
# then on the GPU host (the device tool: carry [".gpu"]), e.g.
#   timeout 560 tests/gpu/run_all.sh /tmp/gpuout .gpu; tar czf $OUT/gpu_logs.tgz -C /tmp gpuout
# (the device tool brings back at most 8 files: tar the folder; the timeout
# keeps the tar inside the tool's 600 s per command). Without QUICK=1 it
# takes more than 10 min (every variant run has the 60 s heavy test): split
# it over calls (SKIP_SANITIZER=1 SKIP_BENCH=1 leaves the tests).
#
# Environment: QUICK=1 runs the default variant's attention tests in full,
# variants 0, 2, 3, 6, 8, 10-17 and 19 on D = 128 only (not 1, 4 and 7)
# and without the heavy folded test (60 s each; the default runs it), the
# benchmark before the sanitizer, and a smaller sanitizer set, 50 s at most
# each (memcheck, racecheck and initcheck of the attention, memcheck of
# variants 15 and 19, synccheck of variants 10's and 16's stage rings, racecheck
# of 16's, memcheck of the codec, racecheck and synccheck of its roles
# kernel; the sanitizers never run the heavy test). With the heavy test in
# every variant run it took more than 10 min on the H200 (2026-12-01), the
# device tool's limit for one command;
# SKIP_SANITIZER=1 skips
# compute-sanitizer; SKIP_BENCH=1 skips
# the benchmark and the PyTorch baseline; BENCH_ITERS (default 200);
# BENCH_VARIANTS (e.g. 3,6: the split-kernel variants to time; default all);
# VARIANTS (e.g. "15 16 17": only these variants' test runs; default all);
# BENCH_TRACE=N (per-block timelines of N calls per row, the bench's --trace); NCU=1 adds
# ncu profiles of the attention and encode kernels and the SASS of the bench.
set -u
out=${1:?usage: run_all.sh OUT_DIR [BUNDLE_DIR]}
bundle=${2:-.gpu}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
declare -A result

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s%N)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  result[$name]="rc=$rc ${dt}ms"
  echo "== $name: rc=$rc (${dt}ms)"
  return $rc
}

quick=${QUICK:-0}
# Variant runs: all configurations, or D = 128 only (QUICK=1).
# QUICK=1 also leaves out the heavy folded test (the default's run keeps it).
no_heavy='-CudaAttendDefaults.Heavy*'
heavy_off() { [ "$quick" = 1 ] && echo "$no_heavy"; }
vfilter() { if [ "$quick" = 1 ]; then echo "*D128*:CudaAttendDefaults.*$no_heavy"; else echo '*'; fi; }

bench() {
  run sdpa_baseline env PYTHONUNBUFFERED=1 python3 "$here/sdpa_baseline.py" --json "$out/sdpa.json" \
    --iters "${BENCH_ITERS:-200}"
  run gpu_bench "$bundle/bin/oscarkv_gpu_bench" --baseline "$out/sdpa.json" --json "$out/bench.json" \
    --iters "${BENCH_ITERS:-200}" ${BENCH_VARIANTS:+--variant "$BENCH_VARIANTS"} \
    ${BENCH_TRACE:+--trace "$BENCH_TRACE"}
}

for t in cuda_codec_test cuda_attend_test; do
  run "$t" "$bundle/bin/$t" --gtest_output="json:$out/$t.json"
  grep -E "^(encode|decode|round trip|D=|Qwen3)|FAILED|Failure" "$out/$t.log" | head -60
done

# The attention tests again with the other split-kernel variants (see
# AttendLauncher::set_variant; the default is 18, auto: 14 or 19): 1 differs
# for D = 128 only.
# VARIANTS (e.g. "15 16 17"): only these variants' runs.
want() { [ -z "${VARIANTS:-}" ] || [[ " $VARIANTS " == *" $1 "* ]]; }
# variant_run V FILTER LINES [PATTERN]: the attention tests under variant V,
# then the log's lines matching PATTERN (its results and failures), at most LINES.
variant_run() {
  local v=$1 filter=$2 lines=$3 pattern=${4:-'^(D=|Qwen3)|FAILED|Failure'}
  want "$v" || return 0
  run cuda_attend_test_variant$v env OSCARKV_CUDA_ATTEND_VARIANT=$v "$bundle/bin/cuda_attend_test" \
    --gtest_filter="$filter" --gtest_output="json:$out/cuda_attend_test_variant$v.json"
  grep -E "$pattern" "$out/cuda_attend_test_variant$v.log" | head -"$lines"
}
if [ "$quick" != 1 ]; then variant_run 1 '*D128*:CudaAttendDefaults.*' 20; fi
variant_run 2 "$(vfilter)" 40
variant_run 0 "$(vfilter)" 20 'FAILED|Failure'
# Integer q·K (3, 4), integer P·V with 24-bit P' (6) and at 4 blocks/SM (7),
# the default's loop fed by the shared-memory stage ring (10), in one
# cluster kernel (11, batches of few items), 16-bit P' (8, the default
# until 2026-12-01), with the short chunk chain (12), with 12's loads after
# the chunk before is first used (13), with the loads after the first tile
# (14), 14 at 4 blocks/SM (15), 12's warp fed by 10's stage ring (16), 16 at
# 4 blocks/SM (17), 15 with the history cut flat over the kv heads (19):
# differ from the others for D = 128, g <= 4 only (6-8, 10-17 and 19 for G =
# D only).
for v in 3 6 8 10 11 12 13 14 15 16 17 19 $([ "$quick" = 1 ] || echo 4 7); do
  variant_run $v "*D128_g1*:*D128_g2*:*D128_g4*:CudaAttendDefaults.*$(heavy_off)" 20
done

if [ "$quick" = 1 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then bench; fi

# The encode's roles kernel: its two roles hand y buffers over on mbarriers.
roles_test=CudaCodecTest.RolesKernelWritesTheStripKernelsBytes
sanitizer_summary() {
  for f in "$out"/sanitizer_*.log; do
    echo "$(basename "$f"): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -1)"
  done
}
if [ "$quick" = 1 ] && [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer > /dev/null; then
  cs="timeout 50 compute-sanitizer"
  run sanitizer_memcheck_attend $cs --tool memcheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1:*D64_g8_groups4:*D256_g1_groups2:*D128_g8_groups2:CudaAttendLimits.*'
  run sanitizer_racecheck_attend $cs --tool racecheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1'
  run sanitizer_memcheck_attend_v15 env OSCARKV_CUDA_ATTEND_VARIANT=15 $cs --tool memcheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" --gtest_filter="*D128_g4_groups1:CudaAttendDefaults.*$no_heavy"
  run sanitizer_memcheck_attend_v19 env OSCARKV_CUDA_ATTEND_VARIANT=19 $cs --tool memcheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" \
    --gtest_filter="*D128_g4_groups1:CudaAttendVariant.FlatCut*"
  run sanitizer_synccheck_ring env OSCARKV_CUDA_ATTEND_VARIANT=10 $cs --tool synccheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" \
    --gtest_filter='*D128_g4_groups1:CudaAttendDefaults.Long*'
  run sanitizer_synccheck_ring_v16 env OSCARKV_CUDA_ATTEND_VARIANT=16 $cs --tool synccheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" \
    --gtest_filter='*D128_g4_groups1:CudaAttendDefaults.Long*'
  run sanitizer_racecheck_ring_v16 env OSCARKV_CUDA_ATTEND_VARIANT=16 $cs --tool racecheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1'
  run sanitizer_initcheck_attend $cs --tool initcheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g8_groups2:*D128_g1_groups1'
  run sanitizer_memcheck_codec $cs --tool memcheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test"
  run sanitizer_racecheck_codec_roles $cs --tool racecheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test" --gtest_filter="$roles_test"
  run sanitizer_synccheck_codec_roles $cs --tool synccheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test" --gtest_filter="$roles_test"
  sanitizer_summary
elif [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer > /dev/null; then
  run sanitizer_memcheck_codec compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test"
  run sanitizer_memcheck_attend compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1:*D64_g8_groups4:*D256_g1_groups2:CudaAttendLimits.*'
  run sanitizer_racecheck_attend compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1'
  run sanitizer_memcheck_attend_v2 env OSCARKV_CUDA_ATTEND_VARIANT=2 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g4_groups1:*D64_g8_groups4'
  run sanitizer_memcheck_attend_v4 env OSCARKV_CUDA_ATTEND_VARIANT=4 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" --gtest_filter="*D128_g4_groups1:CudaAttendDefaults.*$no_heavy"
  run sanitizer_memcheck_attend_v15 env OSCARKV_CUDA_ATTEND_VARIANT=15 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$bundle/bin/cuda_attend_test" --gtest_filter="*D128_g4_groups1:CudaAttendDefaults.*$no_heavy"
  run sanitizer_racecheck_codec timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test" --gtest_filter="*Encode*:$roles_test"
  run sanitizer_synccheck_codec_roles timeout 150 compute-sanitizer --tool synccheck --error-exitcode 9 \
    "$bundle/bin/cuda_codec_test" --gtest_filter="$roles_test"
  run sanitizer_initcheck_attend compute-sanitizer --tool initcheck --error-exitcode 9 \
    "$bundle/bin/cuda_attend_test" --gtest_filter='*D128_g8_groups2'
  run sanitizer_synccheck_ring_v16 env OSCARKV_CUDA_ATTEND_VARIANT=16 compute-sanitizer \
    --tool synccheck --error-exitcode 9 "$bundle/bin/cuda_attend_test" \
    --gtest_filter='*D128_g4_groups1:CudaAttendDefaults.Long*'
  sanitizer_summary
fi

if [ "$quick" != 1 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then bench; fi

# Optional (NCU=1): hardware counters of the three attention kernels at
# B=1 8K and of the split kernel at 128K, the encode kernel, and the SASS.
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats"
  ncu --clock-control none -k regex:"PrepKernel|SplitKernel|MergeKernel" -c 3 --section SpeedOfLight \
    "$bundle/bin/oscarkv_gpu_bench" --only B1_S8192 --variant 0 --iters 5 > "$out/ncu_8k.log" 2>&1
  ncu --clock-control none -k regex:"PrepKernel|SplitKernel|MergeKernel" -c 3 $sections \
    "$bundle/bin/oscarkv_gpu_bench" --only B1_S131072 --variant 0 --iters 5 > "$out/ncu_128k.log" 2>&1
  ncu --clock-control none -k regex:SplitKernel -c 1 $sections \
    "$bundle/bin/oscarkv_gpu_bench" --only B1_S131072 --variant 4 --iters 5 > "$out/ncu_128k_v4.log" 2>&1
  ncu --clock-control none -k regex:EncodeRolesKernel -c 1 $sections \
    "$bundle/bin/oscarkv_gpu_bench" --only none --iters 5 > "$out/ncu_encode.log" 2>&1
  echo "ncu 8K (prep, split, merge):"; grep -E "^  [A-Za-z]|Duration" "$out/ncu_8k.log" | head -12
  echo "ncu 128K:"; grep -E "^  [A-Za-z]|Duration|DRAM Throughput|Issue Slots|Achieved Occupancy|Executed Ipc A|Registers Per" "$out/ncu_128k.log" | head -30
  echo "ncu 128K variant 4:"; grep -E "Duration|DRAM Throughput|Issue Slots|Achieved Occupancy|Executed Ipc A|Registers Per" "$out/ncu_128k_v4.log" | head -8
  echo "ncu encode:"; grep -E "Duration|DRAM Throughput|Issue Slots|Achieved Occupancy|Registers Per|Executed Ipc A|Stall" "$out/ncu_encode.log" | head -12
  if command -v cuobjdump > /dev/null; then
    cuobjdump -sass "$bundle/bin/oscarkv_gpu_bench" > "$out/sass_all.txt" 2>&1
    echo "sass: $(wc -l < "$out/sass_all.txt") lines"
  fi
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo; cat "$out/sdpa_baseline.log"; echo; cat "$out/gpu_bench.log"
fi
echo
echo "== summary"
for k in "${!result[@]}"; do printf '%-32s %s\n' "$k" "${result[$k]}"; done | sort
