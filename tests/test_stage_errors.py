"""A clear error inside a stage's Prefect flow (a missing input, a damaged artifact, bad params) is
said once, as `agentkiln: <message>`, with exit status 2 and no traceback, instead of arriving wrapped
in Prefect's tracebacks (one per task and flow it passed through, then Python's); Prefect still
records the runs as Failed, with the message."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from flows._stage import MissingInput, is_plain
from tests.conftest import copy_worktree


def test_which_errors_are_said_plainly(tmp_path):
    from agentkiln.artifacts import ArtifactError
    from agentkiln.config import ParamsError

    assert is_plain(ParamsError("params.yaml: ...")) and is_plain(ArtifactError("reports/metrics.json: ..."))
    assert is_plain(MissingInput("models/sft is missing")) and isinstance(MissingInput("x"), FileNotFoundError)
    assert is_plain(FileNotFoundError("data/tasks/test/manifest.json: missing; run the synthesize stage first"))
    try:
        open(tmp_path / "nowhere")
    except FileNotFoundError as e:  # the OS's (errno set): maybe a bug, it keeps its traceback
        assert not is_plain(e)
    assert not is_plain(ValueError("a bug"))


@pytest.mark.slow  # ~20-40 s: Prefect's temporary server and the stage's imports
def test_an_error_inside_the_evaluate_flow_is_said_once_without_a_traceback(tmp_path):
    repo = copy_worktree(tmp_path / "repo")
    for d in ("models/sft", "models/rl/main", "models/distilled"):  # past the stage's `needs` check...
        (repo / d).mkdir(parents=True, exist_ok=True)
    # ...but no data/tasks: the evaluate task, inside the evaluate flow, finds no test panel
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # Prefect's temporary server
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    res = subprocess.run([sys.executable, "-m", "flows.evaluate"], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    out = res.stdout + res.stderr
    msg = "data/tasks/test/manifest.json: missing; run the synthesize stage first (dvc repro synthesize)"
    assert res.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert out.count(msg) == 1 and f"agentkiln: {msg}" in res.stderr.splitlines(), out[-4000:]
    # the task and flow runs are recorded Failed with the message (Prefect's database, its temporary server gone)
    db = sqlite3.connect(tmp_path / "prefect" / "prefect.db")
    runs = db.execute("SELECT r.state_type, s.message FROM flow_run r JOIN flow_run_state s ON s.id = r.state_id "
                      "UNION ALL SELECT r.state_type, s.message FROM task_run r "
                      "JOIN task_run_state s ON s.id = r.state_id").fetchall()
    assert len(runs) == 2 and all(state == "FAILED" and msg in message for state, message in runs), runs
