#!/usr/bin/env bash
# Best effort: Debian's bubblewrap, the operating-system sandbox for model-written tool code
# (agentkiln.sandbox, docs/sandbox.md). Without it tool code runs with weaker isolation and a warning;
# AGENTKILN_SANDBOX_ISOLATION=bwrap makes that an error instead (CI sets it).
set -uo pipefail
command -v bwrap >/dev/null 2>&1 && exit 0
bash "$(dirname "$0")/apt_install.sh" "the tool sandbox" \
  "model-written code will run with weaker isolation (docs/sandbox.md)" bubblewrap
