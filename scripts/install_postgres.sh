#!/usr/bin/env bash
# Best effort: Debian's PostgreSQL server, for the team-setup tests (the e2e pipeline then tracks on an
# MLflow server backed by PostgreSQL: tests/team_services.py starts a throwaway cluster on loopback).
# Without it those tests run on the SQLite store and the PostgreSQL-only check is skipped, saying why.
set -uo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" "for the team-setup tests" "the team-setup tests will use SQLite" postgresql
