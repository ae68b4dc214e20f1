#!/usr/bin/env bash
# Best effort: Debian's Chromium for the headless screenshot of the MLflow model page
# (tests/test_mlflow_server.py, python -m agentkiln.registry.ui). Without it that one test is skipped.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -n "${AGENTKILN_CHROMIUM:-}" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "agentkiln: installing Debian's chromium (for the MLflow UI screenshot test)"
  pkgs="chromium fonts-liberation"
  apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1; } \
    || echo "agentkiln: could not install chromium; the screenshot test will be skipped" >&2
else
  echo "agentkiln: no chromium (sudo apt-get install chromium): the screenshot test will be skipped" >&2
fi
exit 0
