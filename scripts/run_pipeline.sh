#!/usr/bin/env bash
# Set up (if needed) and run the whole pipeline on the embedded default: dvc repro + promotion.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"  # slow machines
export PATH="$PWD/.venv/bin:$PATH"
python -m flows.pipeline "$@"
