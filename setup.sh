#!/usr/bin/env bash
# The README's set-up, on a fresh machine: headless Chromium and its driver (the HTML leaderboard's browser test),
# then a virtual environment (default .venv, or the folder given) with lrq-bench and its test dependencies.
# Chromium comes from apt-get on Debian or Ubuntu, as root or with sudo; elsewhere install chromium (or
# chromium-browser) and chromedriver with the system's package manager first: this script then skips them.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${1:-.venv}"
if ! { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; } || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  else
    echo "setup.sh: no apt-get here: install chromium and chromedriver with this system's package manager (the" \
         "browser test needs them); continuing with the Python set-up" >&2
  fi
fi
python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[dev]'
echo "setup.sh: ready; activate with: . $VENV/bin/activate"
