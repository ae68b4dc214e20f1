"""`agentkiln ui` as a user runs it: the two servers up, then SIGTERM (a closed terminal sends SIGHUP,
`kill` SIGTERM) stops both, ports freed and nothing left; a port already taken is refused by name
before anything starts (the old servers' URLs were printed as if they were the new ones)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkiln.servers import free_port, port_taken
from tests.processes import alive, descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the Linux process table")
SCRIPT = Path(sys.executable).parent / "agentkiln"


def env_for(tmp_path: Path) -> dict:
    """A project of its own (the command runs inside one) with its own MLflow store and Prefect home."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", AGENTKILN_MLFLOW_DIR=str(tmp_path),
               PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    return env


def test_a_taken_port_is_refused_by_name_before_anything_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([str(SCRIPT), "ui", "--mlflow-port", str(port), "--prefect-port", str(free_port())],
                             cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"agentkiln ui: port {port} for the MLflow UI is taken" in res.stderr and "--mlflow-port" in res.stderr
    assert "MLflow UI:" not in res.stdout  # no URL of a server that is not ours


def test_sigterm_stops_both_servers_and_frees_their_ports(tmp_path):
    ports = free_port(), free_port()
    proc = subprocess.Popen([str(SCRIPT), "ui", "--mlflow-port", str(ports[0]), "--prefect-port", str(ports[1])],
                            cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        seen, lines = set(), []
        for line in proc.stdout:
            lines.append(line)
            seen |= descendants(proc.pid)
            if line.startswith("Ctrl-C stops both."):
                break
        assert all(port_taken(p) for p in ports), "".join(lines)
        seen |= descendants(proc.pid)  # the servers and their workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        rest = proc.stdout.read()
        assert "stopped by SIGTERM: stopping the servers" in rest, rest
        deadline = time.monotonic() + 15
        while (any(alive(p) for p in seen) or any(port_taken(p) for p in ports)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in seen if alive(p)], "a server outlived `agentkiln ui`"
        assert not any(port_taken(p) for p in ports)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
