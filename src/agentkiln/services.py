"""Long-lived servers on loopback: a Prefect API/UI server (schedules need one) and, with the MLflow
UI server of agentkiln.registry.ui, what `agentkiln ui` starts. Both are agentkiln.servers
ManagedServers: their own process group, stopped with all their children."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agentkiln import lifecycle
from agentkiln.registry.ui import MlflowServer
from agentkiln.servers import ManagedServer, ServerError, free_port, log_tail, port_taken
from agentkiln.tracking import TRAINING_VIEW, store_dir, tracking_uri


class PrefectServer(ManagedServer):
    """`prefect server start` on host:port (a free port by default) with its own PREFECT_HOME when
    `home` is given (a throwaway database for tests), else the user's; started at construction
    (agentkiln.servers.ManagedServer). `wait()` returns the API URL (…/api) once /api/health answers."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, home: str | Path | None = None):
        self.port = port or free_port(host)
        self.api_url = f"http://{host}:{self.port}/api"
        self.ui_url = f"http://{host}:{self.port}"
        # the UI (a single-page app) asks PREFECT_UI_API_URL for data: this server's, not the default port's
        env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_UI_API_URL=self.api_url)
        env.pop("PREFECT_API_URL", None)  # the server must not talk to another one
        if home is not None:
            env["PREFECT_HOME"] = str(home)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(self.port)]
        super().__init__("prefect server", cmd, f"{self.api_url}/health", env=env)

    def wait(self, timeout: float = 180.0) -> str:
        super().wait(timeout)
        return self.api_url


def serve_uis(root: Path, mlflow_port: int, prefect_port: int, out: Callable[[str], object] = print) -> None:
    """Both UIs on loopback until Ctrl-C, SIGTERM or a closed terminal (SIGHUP), then both stopped.
    A port already taken is refused first, by name (a server answering there would otherwise pass
    for the new one); a server that exits on its own ends the command with its log (ServerError)."""
    for name, port, option in (("MLflow", mlflow_port, "--mlflow-port"), ("Prefect", prefect_port, "--prefect-port")):
        if port_taken(port):
            raise ServerError(f"port {port} for the {name} UI is taken: another server listens there (an earlier "
                              f"`agentkiln ui` still running? `ss -ltnp 'sport = :{port}'` names it); stop it, or "
                              f"choose another port with {option}")
    lifecycle.handle_signals()  # SIGTERM / SIGHUP end the wait below like Ctrl-C: the finally stops both servers
    mlflow_server = MlflowServer(tracking_uri(), store_dir() / "mlartifacts", port=mlflow_port)
    prefect_server = PrefectServer(port=prefect_port)
    try:
        mlflow_url = mlflow_server.wait()
        api = prefect_server.wait()
        # MLflow 3's UI opens in its GenAI mode unless told: this link opens (and remembers) model training
        out(f"MLflow UI:  {mlflow_url}/{TRAINING_VIEW}   (store {tracking_uri()})")
        out(f"Prefect UI: {prefect_server.ui_url}")
        out(f"Flows report to this Prefect server once you: export PREFECT_API_URL={api}")
        out("Ctrl-C stops both.")
        while mlflow_server.proc.poll() is None and prefect_server.proc.poll() is None:
            time.sleep(1)
        gone, log = (("MLflow", mlflow_server.log) if mlflow_server.proc.poll() is not None
                     else ("Prefect", prefect_server.log))
        raise ServerError(f"the {gone} server exited on its own; the other was stopped\n{log_tail(log)}")
    except KeyboardInterrupt:
        out("\nstopping the servers")
    except lifecycle.Terminated as e:
        out(f"\nagentkiln ui: {e}: stopping the servers")
        raise
    finally:
        prefect_server.stop()
        mlflow_server.stop()
