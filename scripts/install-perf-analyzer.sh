#!/usr/bin/env bash
# Installs Triton's perf_analyzer (from the tritonclient 2.40.0 wheel) into .venv-perf, so the
# test suite and `make bench` can drive lockgate with it. It never touches the main venv.
# It runs on CPU-only machines given Debian's libb64 and the CUDA runtime library from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PERF_VENV=${PERF_VENV:-.venv-perf}
PYTHON=${PYTHON:-python3}
if [ -x "$PERF_VENV/bin/perf_analyzer" ] && [ -f "$PERF_VENV/.ok" ]; then exit 0; fi
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >/dev/null 2>&1; }) \
      || echo "perf_analyzer: could not install libb64-0d" >&2
  else
    echo "perf_analyzer: needs Debian's libb64-0d (apt-get install libb64-0d)" >&2
  fi
fi
"$PYTHON" -m venv "$PERF_VENV"
"$PERF_VENV/bin/python" -m pip install -q "tritonclient[http]==2.40.0" nvidia-cuda-runtime-cu12
cat > "$PERF_VENV/bin/perf_analyzer_wrapped" <<'WRAP'
#!/usr/bin/env bash
here="$(cd "$(dirname "$0")/.." && pwd)"
cudart="$(ls -d "$here"/lib/python3*/site-packages/nvidia/cuda_runtime/lib 2>/dev/null | head -1)"
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/perf_analyzer" "$@"
WRAP
chmod +x "$PERF_VENV/bin/perf_analyzer_wrapped"
usage=$("$PERF_VENV/bin/perf_analyzer_wrapped" --help 2>&1 || true)
if ! grep -q "SYNOPSIS" <<<"$usage"; then
  echo "perf_analyzer does not run here" >&2
  exit 1
fi
touch "$PERF_VENV/.ok"
