#!/usr/bin/env bash
# Best effort: install Debian packages when running as root with apt-get (apt-get update only if the
# first try fails); otherwise, or when it fails, print why and what it costs. Never fails.
#   bash scripts/apt_install.sh "<what they are for>" "<what happens without them>" PKG...
set -uo pipefail
what=$1 without=$2; shift 2
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "agentkiln: installing Debian's $* ($what)"
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; } \
    || echo "agentkiln: could not install $*: $without" >&2
else
  echo "agentkiln: $* missing (sudo apt-get install $*): $without" >&2
fi
exit 0
