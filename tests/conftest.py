"""Test-wide settings: offline, no telemetry, Prefect and MLflow state in a temporary directory.

Set before any library import (pytest imports conftest first)."""

import os
import tempfile
from pathlib import Path

_TMP = Path(tempfile.mkdtemp(prefix="agentkiln-tests-"))
os.environ.update(
    {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PREFECT_HOME": str(_TMP / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
        "TQDM_DISABLE": "1",
    }
)
# Prefect's temporary API server gets 20 s to start by default: not enough on a loaded 2-core machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.pop("AGENTKILN_PARENT_RUN_ID", None)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_TMP, ignore_errors=True)
