#!/usr/bin/env bash
# Write requirements.lock: every package agentkiln's .venv holds (pyproject.toml's dependencies and its
# dev extra, resolved for Python 3.11), each at one version with the sha256 of each of its files on PyPI.
# scripts/setup.sh installs exactly that set (`--require-hashes`), so a fresh clone gets the bytes the
# committed dvc.lock was made with, whatever PyPI released since. torch is left out: setup installs it
# itself (pyproject.toml pins it exactly; its CPU and CUDA builds are different files).
#
#   bash scripts/lock.sh             # after changing a dependency in pyproject.toml; commit both files
#   bash scripts/lock.sh --upgrade   # move every unpinned dependency to its newest release
# -h, --help: this text.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
bash scripts/setup.sh >/dev/null  # uv comes with the .venv
upgrade=()
[ "${1:-}" = "--upgrade" ] && upgrade=(--upgrade)
# PyPI alone (not this machine's pip configuration): torch resolves to PyPI's build, whose CUDA
# libraries (nvidia-*, cuda-*, triton) come with torch's own install where it takes that build
compile() { UV_NATIVE_TLS=1 UV_CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" .venv/bin/uv pip compile pyproject.toml \
  --extra dev --python-version 3.11 --index-url https://pypi.org/simple --no-config --quiet "$@"; }
cuda=$(compile --no-emit-package torch "${upgrade[@]+"${upgrade[@]}"}" | grep -oE '^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton)==' | tr -d '=')
skip=(--no-emit-package torch)
for p in $cuda; do skip+=(--no-emit-package "$p"); done
# an existing lock keeps its versions where pyproject.toml still allows them (uv reads the output file)
compile --generate-hashes "${skip[@]}" "${upgrade[@]+"${upgrade[@]}"}" -o requirements.lock
echo "requirements.lock: $(grep -c '^[A-Za-z0-9]' requirements.lock) packages pinned with their sha256 (torch and its CUDA libraries: setup.sh)"
