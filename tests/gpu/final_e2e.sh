#!/bin/bash
# End to end on the GPU host (issue 5, item 6): oscarkv-server on the CUDA
# backend, driven over gRPC by oscarkv-demo with a 128K-token cache for all 36
# layers of a Qwen3-8B-shaped model; reports the RPC latency of fused
# Append+Attend next to the server's own attention compute time (its
# oscarkv_attention_compute_seconds histogram). Logs under OUT (arg 1).
#   [POOL=16GiB or a fraction of free GPU memory] tests/gpu/final_e2e.sh OUT [BUNDLE_DIR=.gpu] [TOKENS=131072]
# Takes about 300 s at 128K tokens on an H200 host (2026-11-29): prefill 104 s,
# then decode, the compressed fetch and the demo's CPU-side checks; give it a
# 400 s limit.
set -uo pipefail
out=${1:?usage: final_e2e.sh OUT [BUNDLE] [TOKENS]}
bundle=${2:-.gpu}
tokens=${3:-131072}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/$bundle/bin
"$bin/oscarkv-server" --listen=127.0.0.1:50161 --metrics_listen=127.0.0.1:9571 \
  --backend=cuda --pool_size="${POOL:-16GiB}" > "$out/e2e_server.log" 2>&1 &
pid=$!
for _ in $(seq 1 60); do
  "$bin/oscarkv" info --server=127.0.0.1:50161 --timeout=1 > "$out/e2e_info.txt" 2>&1 && break
  sleep 0.5
done
"$bin/oscarkv-demo" --server=127.0.0.1:50161 --tokens="$tokens" > "$out/e2e_demo.log" 2>&1
echo "demo rc=$?" >> "$out/e2e_demo.log"
python3 - "$out" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9571/metrics", timeout=5).read().decode()
open(sys.argv[1] + "/e2e_metrics.txt", "w").write(text)
vals = {}
for line in text.splitlines():
    if line.startswith("oscarkv_attention_compute_seconds_sum") or \
       line.startswith("oscarkv_attention_compute_seconds_count"):
        name, v = line.rsplit(" ", 1)
        vals[name.split("{")[0]] = float(v)
s = vals.get("oscarkv_attention_compute_seconds_sum", 0.0)
c = vals.get("oscarkv_attention_compute_seconds_count", 0.0)
if c:
    print(f"server attention compute per item: mean {1e6 * s / c:.1f} us over {int(c)} items")
PY
kill -TERM "$pid"; wait "$pid"
tail -n 25 "$out/e2e_demo.log"
