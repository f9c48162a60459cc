#!/usr/bin/env bash
# make bench-peers: lockgate against MLServer, KServe, LitServe, BentoML, Ray Serve and
# llama.cpp's llama-server, one load generator, server on core 0 and client on core 1.
# Installs each peer into .venvs/<peer> and builds llama-server (scripts/build-llama-server.sh,
# into ~/.cache/lockgate/llama.cpp/), both once.
# Extra arguments go to bench_peers.py, e.g. --quick, --servers lockgate,mlserver, --llm ''.
# Writes benchmarks/results/peers.{json,md}.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
mkdir -p "$HERE/.logs"
echo "finding or building llama-server in the background (log: $HERE/.logs/build_llama.log)"
PYTHON="$ROOT/.venv/bin/python" bash "$ROOT/scripts/build-llama-server.sh" \
  > "$HERE/.logs/llama_server_path" 2> "$HERE/.logs/build_llama.log" &
BUILD_PID=$!
bash "$HERE/install.sh" || echo "some peers failed to install; they are skipped (see above)"
echo "waiting for the llama-server build"
if wait "$BUILD_PID"; then
  LOCKGATE_LLAMA_SERVER="$(tail -1 "$HERE/.logs/llama_server_path")"
  export LOCKGATE_LLAMA_SERVER
else
  echo "llama-server build failed: see $HERE/.logs/build_llama.log"
fi
exec "$ROOT/.venv/bin/python" "$HERE/bench_peers.py" "$@"
