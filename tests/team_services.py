"""A team's services for the tests, on loopback: a throwaway PostgreSQL cluster (Debian's server,
run as the unprivileged `postgres` user when the tests run as root: PostgreSQL refuses root) for the
MLflow tracking server's backend store. `postgres_available()` says why not when it cannot run."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from agentkiln.servers import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def postgres_available() -> str | None:
    """None when a cluster can be started here, else the reason (for pytest.skip)."""
    if _bin_dir() is None:
        return "PostgreSQL's server is not installed (scripts/install_postgres.sh: apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no unprivileged `postgres` user to run PostgreSQL as"
    return None


@contextmanager
def postgres_cluster(db: str = "mlflow"):
    """Start a cluster in a temporary directory on a free loopback port with database `db`; yields
    its SQLAlchemy URI; stops it and removes the directory at exit."""
    bins = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="agentkiln-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        os.chown(root, pg.pw_uid, pg.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()

    def run(*argv: str) -> None:
        res = subprocess.run([*as_user, *argv], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")

    try:
        run(str(bins / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        run(str(bins / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        run(str(bins / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", db)
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{db}"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_user, str(bins / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
