#!/usr/bin/env bash
# Best effort: Debian's PostgreSQL server, for the team-setup tests (the e2e pipeline then tracks on an
# MLflow server backed by PostgreSQL: tests/team_services.py starts a throwaway cluster on loopback).
# Without it those tests run on the SQLite store and the PostgreSQL-only checks are skipped, saying why.
set -uo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "agentkiln: installing Debian's postgresql (for the team-setup tests)"
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1; } \
    || echo "agentkiln: could not install postgresql; the team-setup tests will use SQLite" >&2
else
  echo "agentkiln: no PostgreSQL server (sudo apt-get install postgresql): the team-setup tests will use SQLite" >&2
fi
exit 0
