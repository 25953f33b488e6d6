#!/usr/bin/env bash
# The main job (README): sets up and builds (deploy/local/setup.sh), starts
# oscarkv-server on the embedded default (CPU backend unless a GPU is usable,
# data-free Hadamard rotation), and runs oscarkv-demo against it over real
# gRPC: a prefill worker streams a 32K-token Qwen3-8B-shaped cache for all 36
# layers, a decode worker runs fused Append+Attend steps, another fetches the
# cache compressed and attends locally. Prints memory saved, attention error
# vs BF16 and latencies (about a minute on 2 CPU cores).
#   deploy/local/demo.sh [oscarkv-demo flags, e.g. --layers=8 --tokens=8192]
#   OSCARKV_KEEP_SERVER=1 deploy/local/demo.sh   # leave the server running
#   OSCARKV_PORT=50051 OSCARKV_METRICS_PORT=9464 OSCARKV_POOL_SIZE=2GiB (defaults)
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/setup.sh
build=${OSCARKV_BUILD_DIR:-build}
port=${OSCARKV_PORT:-50051}
metrics_port=${OSCARKV_METRICS_PORT:-9464}
log=$(mktemp -t oscarkv-server.XXXXXX.log)
"$build"/server/oscarkv-server --listen=0.0.0.0:"$port" --metrics_listen=0.0.0.0:"$metrics_port" \
  --pool_size="${OSCARKV_POOL_SIZE:-2GiB}" 2>"$log" &
pid=$!
stop() { kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; }
# 127.0.0.1, not localhost: a minimal system (a fresh debootstrap root, some
# containers) may have no /etc/hosts, and gRPC's resolver then fails on it.
server=127.0.0.1:"$port"
ready=0
for _ in $(seq 1 60); do
  if "$build"/client/tool/oscarkv info --server="$server" --timeout=1 >/dev/null 2>&1; then
    ready=1
    break
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "oscarkv-server did not start:" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.5
done
cat "$log"
if [[ ${OSCARKV_KEEP_SERVER:-0} != 1 ]]; then trap stop EXIT; fi
if [[ $ready != 1 ]]; then
  echo "oscarkv-server runs (pid $pid) but did not answer on $server within 30 s" >&2
  exit 1
fi
"$build"/client/oscarkv-demo --server="$server" "$@"
echo
echo "metrics: curl -s http://127.0.0.1:$metrics_port/metrics | grep ^oscarkv_"
if [[ ${OSCARKV_KEEP_SERVER:-0} == 1 ]]; then
  echo "oscarkv-server keeps running (pid $pid, log $log); stop it with: kill $pid"
else
  echo "stopping oscarkv-server; rerun with OSCARKV_KEEP_SERVER=1 to keep it running and point"
  echo "your own client at $server (oscarkv ls/put/get/attend --server=$server)"
fi
