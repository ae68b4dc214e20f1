"""Stopping `agentkiln run` as an operator does, in the middle of the RL stage (tiny params, a
temporary copy of the repository): SIGTERM (`docker stop`, systemd), SIGKILL (after their timeout)
and Ctrl-C (SIGINT to the terminal's foreground process group). Within 15 s nothing of the run is
left in the process table, no MLflow run of it is RUNNING, and no model version was registered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, copy_worktree, merge
from tests.processes import Run, descendants

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                  reason="reads the Linux process table")]

TINY = {
    "synthesize": {"workers": 1, "splits": {
        "sft": {"n_tasks": 4, "seed": 11, "mix": {"frozenlake_easy": 1.0}},
        "rl": {"n_tasks": 2, "seed": 12, "mix": {"frozenlake_easy": 1.0, "python_easy": 1.0}},
        "test": {"n_tasks": 2, "seed": 13, "mix": {"frozenlake_easy": 1.0}},
        "ood": {"n_tasks": 1, "seed": 14, "mix": {"sokoban_easy": 1.0}},
        "val": {"n_tasks": 1, "seed": 15, "mix": {"frozenlake_easy": 1.0}}}},
    "sft": {"epochs": 1, "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                                   "vocab_size": 512}},
    # long enough that the stage is at work when the signal comes
    "rl": {"defaults": {"iterations": 500, "episode_budget": None, "tasks_per_iter": 2, "group_size": 2,
                        "max_turns": 4},
           "stages": {"main": {"init": "sft"}}},  # the default stage's mix names types this pool lacks
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    dst = copy_worktree(tmp_path_factory.mktemp("cli_stop") / "agentkiln")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{dst / 'mlflow.db'}", TMPDIR=str(dst.parent / "tmp"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    (dst.parent / "tmp").mkdir()
    for k in ("AGENTKILN_PARENT_RUN_ID", "PREFECT_API_URL"):
        env.pop(k, None)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for cmd in (["git", "init", "-q"], [*git, "add", "-A"], [*git, "commit", "-qm", "snapshot"]):
        subprocess.run(cmd, cwd=dst, env=env, check=True, capture_output=True)
    return dst, env


def _store(env: dict):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=["SIGTERM", "SIGKILL", "Ctrl-C"])
def test_a_signal_to_agentkiln_run_stops_the_whole_run_within_15_s(repo, tmp_path, sig):
    dst, env = repo
    cli = str(Path(sys.executable).parent / "agentkiln")
    run = Run([cli, "run"], dst, env, tmp_path / "run.log")
    run.watch_until(lambda r: bool(r.processes("flows.rl")) and "for flow 'rl'" in r.output(), timeout=300)
    time.sleep(3.0)  # into its iterations
    run.seen |= descendants(run.proc.pid)
    if sig == signal.SIGINT:
        os.killpg(run.proc.pid, sig)  # a terminal's Ctrl-C: the foreground process group, which is the command's
    else:
        os.kill(run.proc.pid, sig)  # `docker stop` / systemd signal the command's own process
    took = run.wait_gone(timeout=15)
    print(f"{sig.name}: everything gone {took:.1f} s after the signal")
    out = run.output()
    if sig != signal.SIGKILL:
        assert run.proc.returncode == 128 + sig, out[-3000:]
        assert "stopping the run" in out
    store = _store(env)
    assert store.search_model_versions() == []  # the orphaned pipeline never reached promotion
    exp = store.get_experiment_by_name("agentkiln")
    runs = store.search_runs([exp.experiment_id])
    assert {r.info.run_name for r in runs} >= {"pipeline", "rl-main"}
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
