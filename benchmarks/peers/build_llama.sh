#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source carried by the llama-cpp-python sdist.
# Idempotent: does nothing when the binary already exists.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$HERE/.build/llama"
BIN="$WORK/llama.cpp/build/bin/llama-server"
PY="${PYTHON:-python3}"
if [[ -x "$BIN" ]]; then echo "llama-server: $BIN"; exit 0; fi
mkdir -p "$WORK"
cd "$WORK"
if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PY" -m pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$WORK"
fi
if [[ ! -d llama.cpp ]]; then
  SDIST="$(ls llama_cpp_python-*.tar.gz | head -1)"
  tar xzf "$SDIST"
  mv "$(basename "$SDIST" .tar.gz)/vendor/llama.cpp" llama.cpp
  rm -rf "$(basename "$SDIST" .tar.gz)"
fi
cd llama.cpp
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
cmake --build build --target llama-server -j"${BUILD_JOBS:-2}"
echo "llama-server: $BIN"
