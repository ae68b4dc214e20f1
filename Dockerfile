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
ARG TORCH_INDEX_URL=""
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    && pip install --no-cache-dir -e .
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
