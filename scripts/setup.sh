#!/usr/bin/env bash
# Create .venv (Python 3.11) and install agentkiln with its pinned dependencies. Idempotent: when
# .venv was set up from this very pyproject.toml (a stamp holds its hash), nothing is reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_sandbox.sh
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.agentkiln-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
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
pip_install .venv/bin/python -e ".[dev]"
echo "$want" > "$STAMP"
echo "agentkiln: environment ready in .venv"
