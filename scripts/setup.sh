#!/usr/bin/env bash
# Create .venv (Python 3.11) and install agentkiln with its dependencies at the versions and sha256
# digests requirements.lock pins (scripts/lock.sh writes it from pyproject.toml). Idempotent: when .venv
# was set up from these very files (a stamp holds their hash), nothing is reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_sandbox.sh
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.agentkiln-setup
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && .venv/bin/python -c "import agentkiln" 2>/dev/null; then
  echo "agentkiln: environment ready in .venv (up to date)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true

# shellcheck source=scripts/pip_install.sh
source scripts/pip_install.sh
# torch first: the exact CPU build pinned in pyproject.toml (a local wheel is used when one is found).
pip_install .venv/bin/python "torch==2.13.0"
# every other package exactly as locked (a file whose digest differs is refused), then agentkiln itself
pip_install .venv/bin/python --require-hashes --no-deps -r requirements.lock
pip_install .venv/bin/python --no-deps -e .
echo "$want" > "$STAMP"
echo "agentkiln: environment ready in .venv"
