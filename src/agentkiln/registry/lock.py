"""One registry writer at a time: an exclusive `flock` on a file beside the MLflow store.

MLflow's registry calls are each atomic, but a promotion is a sequence of them (read the champion,
gate, move `previous` / `champion`, tag `promoted_over`): two processes interleaving it lose a
champion from the rollback chain, and two `set alias` calls of the same alias race on the store's
unique key (`UNIQUE constraint failed: registered_model_aliases`). Every registry write of agentkiln
(registration, promotion, rollback) runs inside `registry_lock()`, which re-reads nothing itself:
callers read the state they act on *inside* the lock.

Where the lock file lives (one per store, shared by every process that uses the store):
  - `sqlite:///path/mlflow.db`         -> `path/mlflow.db.registry.lock`
  - a file store (`file:///dir`, `dir`) -> `dir.registry.lock`
  - any other store (a server, a database) -> a file in the temporary directory named after the URI:
    it serialises the processes of this machine only
  - `AGENTKILN_REGISTRY_LOCK=<path>` overrides all of these.

The kernel releases a `flock` when its holder dies (even by SIGKILL): a killed promotion never
leaves the store locked. The lock is re-entrant within a thread and serialises threads of a process.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

LOCK_ENV = "AGENTKILN_REGISTRY_LOCK"
TIMEOUT_S = 600.0  # a promotion holds the lock for well under a second; this is for a hung holder
SUFFIX = ".registry.lock"

_guard = threading.RLock()  # threads of this process, and re-entry from the same thread
_held: dict[str, int] = {}  # lock path -> the open descriptor holding its flock


def lock_path(uri: str) -> Path:
    """The lock file of the registry at `uri` (see the module docstring)."""
    if override := os.environ.get(LOCK_ENV):
        return Path(override).resolve()
    uri = str(uri)
    scheme = urlparse(uri).scheme
    if scheme == "sqlite" and uri.startswith("sqlite:///"):
        db = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
        if db and db != ":memory:":
            p = Path(db).resolve()  # sqlite:///rel.db is relative to the working directory, as for MLflow
            return p.with_name(p.name + SUFFIX)
    elif scheme in ("", "file"):
        store = Path(unquote(urlparse(uri).path) if scheme == "file" else uri).resolve()
        return store.with_name(store.name + SUFFIX)
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"agentkiln-registry-{digest}.lock"


def _acquire(path: Path, timeout: float) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    deadline = time.monotonic() + timeout
    delay = 0.002
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise TimeoutError(f"the model registry lock {path} is held by process {holder} for more than "
                                       f"{timeout:.0f} s (another promotion or rollback); nothing was changed") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the timeout message
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def registry_lock(uri: str | None = None, timeout: float = TIMEOUT_S) -> Iterator[Path]:
    """Hold the store's registry lock for the block; yields the lock file's path. `uri`: the
    registry URI (default: MLflow's current one)."""
    if uri is None:
        import mlflow

        uri = mlflow.get_registry_uri()
    path = lock_path(uri)
    key = str(path)
    with _guard:
        if key in _held:  # re-entered by the thread that holds it
            yield path
            return
        fd = _acquire(path, timeout)
        _held[key] = fd
        try:
            yield path
        finally:
            del _held[key]
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
