#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real: Chromium and ChromeDriver
# (the dashboard test), promtool (from `prometheus`, to check /metrics), redis-server
# (the shared response cache) and gcc (the language models' decode attention kernel, built
# on first use; without it they attend through SDPA). Packages already present are skipped; without root or
# apt-get it says what to install and the tests that need a missing tool skip themselves.
set -uo pipefail
declare -A need=(
  [chromium]=/usr/bin/chromium
  [chromium-driver]=/usr/bin/chromedriver
  [prometheus]=/usr/bin/promtool
  [redis-server]=/usr/bin/redis-server
  [gcc]=/usr/bin/cc
)
missing=()
for package in "${!need[@]}"; do
  [ -x "${need[$package]}" ] || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "system packages: please install ${missing[*]} (apt-get install ${missing[*]})" >&2
  exit 0
fi
echo "system packages: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null 2>&1 \
       && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } \
  || echo "system packages: could not install ${missing[*]}" >&2
# The Debian packages start their services; the tests start their own on free ports.
for service in prometheus redis-server; do
  command -v systemctl >/dev/null && systemctl stop "$service" >/dev/null 2>&1
  pkill -x "$service" >/dev/null 2>&1
done
exit 0
