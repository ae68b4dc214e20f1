# agentkiln images. CPU (default) and GPU differ only in the torch build:
#   docker build -t agentkiln:cpu .                                  # torch's CPU wheel (no CUDA libraries)
#   docker build --build-arg TORCH_VARIANT=cu128 -t agentkiln:gpu .  # torch's CUDA 12.8 wheel; run with --gpus all
# Run (bubblewrap, the tool sandbox, needs user namespaces, which Docker's default seccomp profile blocks):
#   docker run --rm --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     -v agentkiln-data:/app/data -v agentkiln-models:/app/models -v agentkiln-reports:/app/reports \
#     -v agentkiln-mlflow:/app/mlstore -v agentkiln-dvc-cache:/app/.dvc/cache agentkiln:cpu agentkiln run
# The volumes keep data, models, reports, the MLflow store (mlflow.db + artifacts) and DVC's cache
# between containers; a second `agentkiln run` then re-runs nothing. docs/operations.md has more.
FROM python:3.11-slim

# bubblewrap: the operating-system sandbox for model-written tool code (docs/sandbox.md); git: DVC
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends git bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 agentkiln

WORKDIR /app
ARG TORCH_VARIANT=cpu
# Dependencies first, from requirements.lock alone (every package at the version and sha256 digest it
# pins, as scripts/setup.sh installs them), so an edit of the source does not reinstall them.
COPY requirements.lock ./
RUN pip install --no-cache-dir torch==2.13.0 --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
    && pip install --no-cache-dir --require-hashes --no-deps -r requirements.lock \
    && python -c "import torch, sys; v='${TORCH_VARIANT}'; sys.exit((v == 'cpu') != (torch.version.cuda is None) \
       and f'TORCH_VARIANT={v} installed torch {torch.__version__} (CUDA {torch.version.cuda})')"

COPY --chown=agentkiln:agentkiln . .
RUN pip install --no-cache-dir --no-deps -e . \
    && mkdir -p data models reports mlstore .dvc/cache && chown -R agentkiln:agentkiln /app

USER 1000:1000
# DVC needs a git repository; a build context without .git (.dockerignore) gets a fresh one.
RUN git init -q && git add -A && git -c user.name=docker -c user.email=docker@localhost commit -qm "image snapshot"
ENV MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 AGENTKILN_SANDBOX_ISOLATION=bwrap AGENTKILN_MLFLOW_DIR=/app/mlstore
VOLUME ["/app/data", "/app/models", "/app/reports", "/app/mlstore", "/app/.dvc/cache"]
CMD ["agentkiln", "--help"]
