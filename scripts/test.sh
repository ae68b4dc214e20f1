#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, end-to-end DVC test included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_browser.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "agentkiln: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
