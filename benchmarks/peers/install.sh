#!/usr/bin/env bash
# Installs each peer server into its own venv under .venvs/<peer>, idempotently.
# Usage: install.sh [peer ...]   (default: all peers)
# A peer whose install fails is logged and skipped; the others go on.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
COMMON=(numpy onnxruntime==1.31.1 tokenizers==0.23.3)

packages_for() {
  case "$1" in
    mlserver) echo "mlserver mlserver-sklearn scikit-learn==1.9.1" ;;
    kserve) echo "kserve" ;;
    litserve) echo "litserve" ;;
    bentoml) echo "bentoml" ;;
    ray) echo "ray[serve]" ;;
    *) echo "unknown peer $1" >&2; return 1 ;;
  esac
}

install_peer() {
  local peer="$1" venv="$HERE/.venvs/$1"
  if [[ -f "$venv/.installed" ]]; then echo "[$peer] already installed"; return 0; fi
  echo "[$peer] installing into $venv"
  "$PY" -m venv "$venv" || return 1
  "$venv/bin/pip" install --quiet --upgrade pip || return 1
  # shellcheck disable=SC2046
  "$venv/bin/pip" install --quiet "${COMMON[@]}" $(packages_for "$peer") || return 1
  "$venv/bin/pip" freeze > "$venv/.installed"
  echo "[$peer] installed"
}

PEERS=("$@")
[[ ${#PEERS[@]} -eq 0 ]] && PEERS=(mlserver kserve litserve bentoml ray)
mkdir -p "$HERE/.venvs"
status=0
for peer in "${PEERS[@]}"; do
  install_peer "$peer" || { echo "[$peer] INSTALL FAILED" >&2; status=1; }
done
exit $status
