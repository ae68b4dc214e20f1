"""Managed servers: one way to run a long-lived server process on loopback (MLflow's, Prefect's).

    server = ManagedServer("mlflow server", cmd, "http://127.0.0.1:5000/health")  # started now
    server.wait()   # until GET health answers 200; ServerError with its log's tail if it exits first
    server.stop()   # SIGTERM to its whole process group, SIGKILL after the grace; its log removed

The server runs in a session of its own (a terminal's Ctrl-C reaches it through us, once) with its
output in a temporary log file; `wait` checks the process before and after each health answer, so a
server that died while another program answers on its port is not taken for it. Start early and wait
later to overlap a slow start-up (MLflow and Prefect import for seconds) with other work. Ports a
command needs fixed are checked first with `port_taken`, and refused by name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from agentkiln.lifecycle import stop_group


class ServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on host:port (a server left running, another program)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def healthy(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a process started in its own session and everything in its group (uvicorn / gunicorn
    workers included): SIGTERM, SIGKILL after `grace` seconds; then reap it."""
    if proc.poll() is None:
        stop_group(proc.pid, grace)
    proc.wait()


class ManagedServer:
    """`cmd` started now in its own session, its output in a temporary log (module docstring)."""

    def __init__(self, name: str, cmd: list[str], health_url: str, env: dict | None = None,
                 cwd: str | Path | None = None):
        self.name, self.cmd, self.health_url = name, cmd, health_url
        log_fd, log_name = tempfile.mkstemp(prefix=f"{name.replace(' ', '-')}-", suffix=".log")
        self.log = Path(log_name)
        with os.fdopen(log_fd, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=cwd, start_new_session=True)

    def _fail(self, why: str) -> ServerError:
        return ServerError(f"{why}\ncommand: {' '.join(self.cmd)}\n--- server log (tail) ---\n{log_tail(self.log)}")

    def wait(self, timeout: float = 180.0) -> None:
        """Return once the health URL answers; ServerError (with the tail of the server's log) if the
        server exits first or does not answer within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        # poll() first, also after a healthy answer: another server may have taken the port
        while self.proc.poll() is not None or not healthy(self.health_url):
            if self.proc.poll() is not None:
                raise self._fail(f"{self.name} exited with code {self.proc.returncode} before answering "
                                 f"{self.health_url}")
            if time.monotonic() > deadline:
                raise self._fail(f"{self.name} did not answer GET {self.health_url} within {timeout:.0f}s")
            time.sleep(0.25)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
