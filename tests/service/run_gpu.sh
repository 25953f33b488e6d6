#!/bin/bash
# Runs the service on the GPU host from a gpu-bundle (see ../shared/docs/GPU.md):
# the service tests against the CUDA backend, the service bench on CUDA and
# CPU, and the demo against a CUDA-backed server. Logs go to OUT (arg 1).
#   [SKIP_SERVICE_BENCH=1] [TEST_TIMEOUT=300] tests/service/run_gpu.sh OUT [BUNDLE_DIR=.gpu]
set -uo pipefail
out=${1:?usage: run_gpu.sh OUT [BUNDLE]}
bundle=${2:-.gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/$bundle/bin
export OSCARKV_PUT_AND_DIE=$bin/put_and_die
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
summary=()
for t in service_roundtrip_test service_bad_input_test service_fault_test service_idle_stream_test \
         service_metrics_test service_calibration_test service_calibration_dir_test \
         server_pool_size_test sharded_client_test; do
  [ -x "$bin/$t" ] || continue
  t0=$SECONDS
  if OSCARKV_TEST_BACKEND=cuda timeout "${TEST_TIMEOUT:-300}" "$bin/$t" > "$out/$t.log" 2>&1; then
    summary+=("$t(cuda): PASS ($((SECONDS - t0)) s)")
  else
    summary+=("$t(cuda): FAIL ($((SECONDS - t0)) s)")
  fi
done
if [ "${SKIP_SERVICE_BENCH:-0}" != 1 ]; then
  timeout 240 "$bin/service_bench" --backend=cuda > "$out/service_bench_cuda.txt" 2>&1
  summary+=("service_bench cuda: rc=$?")
  timeout 240 "$bin/service_bench" --backend=cpu > "$out/service_bench_cpu.txt" 2>&1
  summary+=("service_bench cpu: rc=$?")
fi
"$bin/oscarkv-server" --listen=127.0.0.1:50151 --metrics_listen=127.0.0.1:9564 \
  --backend=cuda --pool_size=8GiB > "$out/server.log" 2>&1 &
pid=$!
sleep 3
timeout 240 "$bin/oscarkv-demo" --server=127.0.0.1:50151 > "$out/demo.txt" 2>&1
summary+=("demo cuda: rc=$?")
curl -s http://127.0.0.1:9564/metrics > "$out/metrics.txt" 2>/dev/null || true
kill -TERM "$pid"
wait "$pid"
summary+=("server exit: $?")
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
