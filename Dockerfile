# agentkiln on the embedded CPU default: installs the project and runs the whole pipeline.
#   docker build -t agentkiln . && docker run --rm --security-opt seccomp=unconfined \
#     --security-opt apparmor=unconfined -v "$PWD/out:/app/reports" agentkiln
FROM python:3.11-slim
# bubblewrap: the operating-system sandbox for model-written tool code (docs/sandbox.md)
RUN apt-get update && apt-get install -y --no-install-recommends git build-essential bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 agentkiln
WORKDIR /app
COPY . .
# Pass --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> for a small CPU-only image;
# by default pip takes torch 2.13.0 from PyPI. Everything else comes from pyproject.toml.
# GPU image: --build-arg TORCH_VARIANT=cu128 (or cu126, cu130, ...): torch's CUDA build from PyTorch's
# wheel index (the CUDA libraries come in the wheels, the driver from the host: NVIDIA Container Toolkit).
#   docker build --build-arg TORCH_VARIANT=cu128 -t agentkiln:gpu .
#   docker run --rm --gpus all --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     -v /models:/models:ro -v "$PWD/out:/app/reports" agentkiln:gpu sh -c "python scripts/apply_profile.py \
#     profiles/gpu-qwen2.5.yaml --set sft.model.source=/models/Qwen2.5-0.5B-Instruct && python -m flows.pipeline"
# (vLLM rollouts need their own environment: scripts/install_vllm.sh; not in this image.)
ARG TORCH_INDEX_URL=""
ARG TORCH_VARIANT=""
RUN index="${TORCH_INDEX_URL:-${TORCH_VARIANT:+https://download.pytorch.org/whl/$TORCH_VARIANT}}" \
    && pip install --no-cache-dir torch==2.13.0 ${index:+--index-url "$index"} \
    && pip install --no-cache-dir -e . \
    && case "$TORCH_VARIANT" in cu*) python -c "import torch, sys; sys.exit(torch.version.cuda is None and \
       'TORCH_VARIANT=$TORCH_VARIANT installed a torch without CUDA: ' + torch.__version__)";; esac
ENV MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# DVC needs a git repository; a build context copied without .git gets a fresh one.
RUN (git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && git add -A \
    && git -c user.name=docker -c user.email=docker@localhost commit -qm "image snapshot"))
# never root at run time; tool code refuses to run without bubblewrap, which needs user namespaces:
#   docker run --rm --security-opt seccomp=unconfined --security-opt apparmor=unconfined agentkiln
# (Docker's default seccomp profile blocks them; without those flags the tool families fail loudly)
RUN chown -R agentkiln:agentkiln /app
USER agentkiln
ENV AGENTKILN_SANDBOX_ISOLATION=bwrap
CMD ["python", "-m", "flows.pipeline"]
