#!/bin/sh
# Starts oscarkv-server from a build tree on this machine and runs the demo
# client against it; the server keeps running afterwards (stop: kill its pid).
#   deploy/run_local.sh [BUILD_DIR] [extra server flags...]
set -eu
BUILD=${1:-build}
[ $# -gt 0 ] && shift
PORT=${OSCARKV_PORT:-50051}
"$BUILD/server/oscarkv-server" --listen=0.0.0.0:"$PORT" --pool_size=2GiB "$@" &
PID=$!
echo "oscarkv-server pid $PID on port $PORT"
# Wait for the port (up to 30 s).
i=0
until "$BUILD/client/tool/oscarkv" info --server=localhost:"$PORT" --timeout=1 >/dev/null 2>&1; do
  i=$((i + 1))
  [ $i -gt 30 ] && { echo "server did not come up" >&2; kill "$PID"; exit 1; }
  sleep 1
done
"$BUILD/client/oscarkv-demo" --server=localhost:"$PORT"
echo "server still running (pid $PID): oscarkv ls --server=localhost:$PORT; kill $PID to stop"
