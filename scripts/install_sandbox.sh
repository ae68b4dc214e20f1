#!/usr/bin/env bash
# Best effort: Debian's bubblewrap, the operating-system sandbox for model-written tool code
# (agentkiln.sandbox, docs/sandbox.md). Without it tool code runs with weaker isolation and a warning;
# AGENTKILN_SANDBOX_ISOLATION=bwrap makes that an error instead (CI sets it).
set -uo pipefail
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "agentkiln: installing Debian's bubblewrap (the tool sandbox)"
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1; } \
    || echo "agentkiln: could not install bubblewrap; model-written code will run with weaker isolation" >&2
else
  echo "agentkiln: bubblewrap is missing (sudo apt-get install bubblewrap): model-written code will run" \
       "with weaker isolation (docs/sandbox.md)" >&2
fi
exit 0
