# Sourced by scripts/setup.sh and scripts/install_vllm.sh: `pip_install PYTHON REQUIREMENT...` installs
# into the environment of PYTHON with uv (from PyPI, ~10x faster than pip: .venv's setup 3 min 50 s ->
# ~30 s on a 2-core machine), reading pip's own configuration (find-links, extra indexes, constraints);
# pip does the install wherever uv cannot be had or fails. Bytecode is compiled at install as pip does
# (where PYTHONDONTWRITEBYTECODE is set nothing would ever be cached: every process would recompile).
pip_install() {
  local py=$1; shift
  # uv: the target environment's, else the repository's .venv's (setup installed it), else one
  # installed into the target environment
  local uv repo_uv
  uv=$(dirname "$py")/uv
  repo_uv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/uv"
  [ -x "$uv" ] || [ ! -x "$repo_uv" ] || uv=$repo_uv
  if [ -x "$uv" ] || "$py" -m pip install --quiet uv >/dev/null 2>&1; then
    local opts=() v
    for v in $("$py" -m pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do opts+=(--find-links "$v"); done
    for v in $("$py" -m pip config get global.extra-index-url 2>/dev/null) ${PIP_EXTRA_INDEX_URL:-}; do opts+=(--extra-index-url "$v"); done
    for v in $("$py" -m pip config get global.constraint 2>/dev/null) ${PIP_CONSTRAINT:-}; do opts+=(--constraint "$v"); done
    # as pip does: best match over every index, the system's certificates
    if UV_NATIVE_TLS=1 "$uv" pip install --quiet --python "$py" --index-strategy unsafe-best-match --compile-bytecode \
        "${opts[@]}" "$@"; then
      return 0
    fi
    echo "agentkiln: uv could not install $*; pip will" >&2
  fi
  "$py" -m pip install --quiet --disable-pip-version-check "$@"
}
