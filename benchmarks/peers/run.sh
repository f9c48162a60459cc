#!/usr/bin/env bash
# make bench-peers: lockgate against MLServer, KServe, LitServe, BentoML, Ray Serve and
# llama.cpp's llama-server, one load generator, server on core 0 and client on core 1.
# Installs each peer into .venvs/<peer> and builds llama-server into .build/ (both once).
# Extra arguments go to bench_peers.py, e.g. --quick, --servers lockgate,mlserver, --llm ''.
# Writes benchmarks/results/peers.{json,md}.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
mkdir -p "$HERE/.logs"
if [[ ! -x "$HERE/.build/llama/llama.cpp/build/bin/llama-server" ]]; then
  echo "building llama-server in the background (log: $HERE/.logs/build_llama.log)"
  bash "$HERE/build_llama.sh" > "$HERE/.logs/build_llama.log" 2>&1 &
  BUILD_PID=$!
fi
bash "$HERE/install.sh" || echo "some peers failed to install; they are skipped (see above)"
if [[ -n "${BUILD_PID:-}" ]]; then
  echo "waiting for the llama-server build"
  wait "$BUILD_PID" || echo "llama-server build failed: see $HERE/.logs/build_llama.log"
fi
exec "$ROOT/.venv/bin/python" "$HERE/bench_peers.py" "$@"
