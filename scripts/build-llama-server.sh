#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source that the llama-cpp-python sdist on PyPI
# carries (vendor/llama.cpp), for `make bench`'s llm_engine suite to run beside lockgate on
# the same GGUF. The binary is kept in $LLAMA_SERVER_DIR (default
# ~/.cache/lockgate/llama.cpp/<version>), and a second run reuses it. Needs cmake and a C++
# compiler (installed from Debian's packages when missing and run as root); about 9 minutes
# on 2 cores. Prints the binary's path.
# LLAMA_SERVER_BUILT_ONLY=1: only find a binary built before, never build.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${LLAMA_SERVER_DIR:-${LOCKGATE_CACHE_DIR:-$HOME/.cache/lockgate}/llama.cpp/$VERSION}
BIN="$DIR/llama-server"
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi
if [ -n "${LLAMA_SERVER_BUILT_ONLY:-}" ]; then
  echo "build-llama-server: not built yet in $DIR (run scripts/build-llama-server.sh)" >&2
  exit 1
fi
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "build-llama-server: installing cmake and g++" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends cmake g++ >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && apt-get install -y -q --no-install-recommends cmake g++ >/dev/null 2>&1; }
  fi
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-server: needs $tool (apt-get install cmake g++)" >&2; exit 1; }
done
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "build-llama-server: downloading llama-cpp-python $VERSION's source from PyPI" >&2
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "build-llama-server: no llama.cpp source in the sdist" >&2; exit 1; }
echo "build-llama-server: configuring (the web UI is left out: its build downloads it)" >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
  >"$WORK/configure.log" 2>&1 || { tail -20 "$WORK/configure.log" >&2; exit 1; }
echo "build-llama-server: building llama-server (about 9 minutes on 2 cores)" >&2
cmake --build "$WORK/build" --target llama-server -j"$(nproc)" 2>&1 \
  | grep --line-buffered -E '^\[ *[0-9]+%\]' | awk 'NR % 20 == 1 { print; fflush() }' >&2 || true
[ -x "$WORK/build/bin/llama-server" ] || { echo "build-llama-server: the build failed" >&2; exit 1; }
mkdir -p "$DIR"
cp "$WORK/build/bin/llama-server" "$DIR/llama-server.tmp"
mv "$DIR/llama-server.tmp" "$BIN"
echo "$BIN"
