"""agentkiln.servers.ManagedServer, the one start / wait / stop of every server agentkiln runs (MLflow's
and Prefect's subclass it): a real HTTP server and a shell that starts a second process in its group."""

import sys

import pytest

from agentkiln.lifecycle import group_members
from agentkiln.servers import ManagedServer, ServerError, free_port, port_taken


def test_a_server_is_waited_for_and_stopped_with_every_process_of_its_group(tmp_path):
    port = free_port()
    # the HTTP server and a second process (a worker, as uvicorn's) in the server's process group
    cmd = ["sh", "-c", f"sleep 300 & exec {sys.executable} -m http.server {port} --bind 127.0.0.1 "
           f"--directory {tmp_path}"]
    with ManagedServer("http server", cmd, f"http://127.0.0.1:{port}/") as server:
        server.wait(timeout=60)
        assert port_taken(port)
        members = group_members(server.proc.pid)
        assert len(members) == 2 and server.proc.pid in members  # the server and its sleeping companion
        log = server.log
        assert log.is_file()
    assert group_members(server.proc.pid) == [] and server.proc.returncode is not None
    assert not port_taken(port) and not log.exists()  # nothing left: no process, no port, no log


def test_a_server_that_exits_first_is_reported_with_its_log():
    server = ManagedServer("broken server", [sys.executable, "-c", "print('no config here'); raise SystemExit(3)"],
                           f"http://127.0.0.1:{free_port()}/health")
    try:
        with pytest.raises(ServerError) as e:
            server.wait(timeout=60)
    finally:
        server.stop()
    msg = str(e.value)
    assert msg.startswith("broken server exited with code 3 before answering http://127.0.0.1:")
    assert "no config here" in msg and "command: " in msg  # its log's tail and the command that ran
