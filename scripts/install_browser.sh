#!/usr/bin/env bash
# Best effort: Debian's Chromium for the headless screenshots of the MLflow and Prefect UIs
# (tests/test_mlflow_server.py, python -m agentkiln.registry.ui). Without it those checks are skipped.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -n "${AGENTKILN_CHROMIUM:-}" ]; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" "for the MLflow UI screenshot test" "the screenshot test will be skipped" \
  chromium fonts-liberation
