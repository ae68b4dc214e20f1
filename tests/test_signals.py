"""Stopping real runs (tiny params, a temporary copy of the repository): SIGTERM to the process group
of `python -m flows.pipeline` mid-stage, SIGKILL of a stage's process. The run must be gone within
seconds, with every process it started (the stage, DVC, Prefect's temporary server, pool workers,
sandbox servers) and its temporary files.

What a run started is read from the process table (/proc): every process whose environment carries
this test's marker variable, plus every descendant seen while the run was alive."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, copy_worktree, merge
from tests.processes import Run, alive, cmdline, descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the Linux process table")

TINY = {
    "synthesize": {
        "workers": 2,
        # enough TextWorld games (~1 s each) that the stage is still at work when the signal comes
        "splits": {"sft": {"n_tasks": 24, "seed": 11, "mix": {"coin_easy": 1.0, "python_easy": 1.0}},
                   "rl": {"n_tasks": 2, "seed": 12, "mix": {"frozenlake_easy": 1.0}},
                   "test": {"n_tasks": 2, "seed": 13, "mix": {"frozenlake_easy": 1.0}},
                   "ood": {"n_tasks": 1, "seed": 14, "mix": {"frozenlake_medium": 1.0}},
                   "val": {"n_tasks": 1, "seed": 15, "mix": {"frozenlake_easy": 1.0}}},
    },
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the repository (git and DVC) with tiny params; its own MLflow store and TMPDIR."""
    dst = tmp_path_factory.mktemp("signals") / "agentkiln"
    copy_worktree(dst)
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{dst / 'mlflow.db'}"
    env["TMPDIR"] = str(dst.parent / "tmp")
    (dst.parent / "tmp").mkdir()
    for k in ("AGENTKILN_PARENT_RUN_ID", "PREFECT_API_URL"):
        env.pop(k, None)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-qm", "snapshot"], cwd=dst, check=True)
    return dst, env


def _tmp_files(env: dict) -> set[Path]:
    """The run's temporary directory's entries, but torch's compile cache (torchinductor_<user>: made
    at import, before the run has its own temporary directory, and shared by every torch process)."""
    return {p for p in Path(env["TMPDIR"]).iterdir() if not p.name.startswith("torchinductor_")}


def _stage_at_work(stage: str):
    """Ready when the stage's process runs its flow (Prefect logged its start) under DVC."""
    def ready(run: Run) -> bool:
        return bool(run.processes(f"flows.{stage}")) and f"for flow '{stage}'" in run.output()
    return ready


def test_sigterm_to_the_pipelines_process_group_stops_everything_within_seconds(repo, tmp_path):
    dst, env = repo
    before = _tmp_files(env)
    run = Run([sys.executable, "-m", "flows.pipeline"], dst, env, tmp_path / "pipeline.log")
    run.watch_until(_stage_at_work("synthesize"), timeout=240)
    time.sleep(0.5)  # well inside the stage's work (TextWorld games, sandboxed tool tasks in pool workers)
    run.seen |= descendants(run.proc.pid)
    assert run.processes("uvicorn") and run.processes("dvc")  # Prefect's temporary server, DVC, the stage
    os.killpg(run.proc.pid, signal.SIGTERM)
    took = run.wait_gone(timeout=30)
    print(f"everything gone {took:.1f} s after SIGTERM")
    out = run.output()
    assert run.proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and took < 30
    assert _tmp_files(env) == before  # its temporary files (sandbox directories included) gone
    assert not (dst / "data" / "tasks" / "summary.json").exists()  # the stage did not finish


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stage_killed_alone_leaves_no_prefect_server_or_worker_behind(repo, tmp_path, sig):
    """The signal to the stage's process only (`kill <pid>`), not to its group."""
    dst, env = repo
    before = _tmp_files(env)
    run = Run([sys.executable, "-m", "flows.synthesize"], dst, env, tmp_path / "synthesize.log")
    run.watch_until(lambda r: bool(r.processes("uvicorn")) and bool(r.processes("spawn_main"))
                    and "for flow 'synthesize'" in r.output(), timeout=240)
    time.sleep(0.5)
    run.seen |= descendants(run.proc.pid)
    server, workers = run.processes("uvicorn"), run.processes("multiprocessing")
    assert server and workers  # Prefect's temporary server; the pool building tasks
    os.kill(run.proc.pid, sig)
    # a guard against a hang, not a speed claim: a SIGTERM run took 10.6 s on a loaded 2-core host (session 17)
    took = run.wait_gone(timeout=30)
    print(f"everything gone {took:.1f} s after {sig.name}")
    assert not any(alive(p) for p in server + workers)  # the pool's workers got the signal too
    if sig == signal.SIGKILL:  # nothing of the stage could clean up: the next run removes its temporary files
        assert run.proc.returncode == -signal.SIGKILL
        left = [d for d in Path(env["TMPDIR"]).iterdir() if d.name.startswith(f"agentkiln-run-{run.proc.pid}-")]
        assert left
        subprocess.run([sys.executable, "-c", "from agentkiln import lifecycle; lifecycle.private_tmpdir()"],
                       env=env, check=True)
        assert not any(d.exists() for d in left)
    else:
        assert run.proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in run.output()
        assert _tmp_files(env) == before


def test_a_stage_run_through_dash_still_dies_with_dvc(tmp_path):
    """dash (DVC's shell where $SHELL is unset) does not hand the process over to the stage, so the
    stage's parent outlives a SIGKILLed DVC: the stage watches DVC itself."""
    dash = shutil.which("dash")
    if dash is None:
        pytest.skip("no dash here")
    flag = tmp_path / "flag"
    child = tmp_path / "stage.py"
    child.write_text(
        "import os, sys, time\n"
        "started_by = os.getppid()\n"
        "from agentkiln import lifecycle\n"
        "lifecycle.handle_signals()\n"
        "lifecycle.die_with_dvc(started_by, poll_s=0.1)\n"
        "open(sys.argv[1], 'w').write('ready')\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except lifecycle.Terminated:\n"
        "    open(sys.argv[1], 'w').write('terminated')\n"
        "    raise\n")
    # a stand-in for DVC (an argument of its command line is `dvc`) running the stage through dash
    fake_dvc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[2:])", "dvc",
                                 dash, "-c", f"{sys.executable} {child} {flag}"], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (flag.exists() and flag.read_text() == "ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    stage = [p for p in descendants(fake_dvc.pid) if cmdline(p[0]).startswith(f"{sys.executable} {child}")]
    assert len(stage) == 1
    os.kill(fake_dvc.pid, signal.SIGKILL)
    fake_dvc.wait()
    deadline = time.monotonic() + 10
    while alive(stage[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(stage[0])
    os.killpg(fake_dvc.pid, signal.SIGKILL) if left else None
    assert not left and flag.read_text() == "terminated"
