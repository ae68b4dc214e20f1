"""scripts/run_log.py: a run's row in docs/runs.md from a real MLflow store (a parent run `pipeline` with a
child run per stage, as the pipeline logs them) and dvc.lock; the row of a run already logged is replaced;
a missing store or run is one line naming it and the next step."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_log.py"
T0 = 1_796_190_160_000  # 2026-12-02 05:42:40 UTC, in ms
# stage -> (start offset s, duration s): what the row must show as m:ss
STAGES = {"synthesize": (5, 100), "base": (110, 21), "sft": (140, 368), "rl-main": (520, 508),
          "distill": (1040, 350), "evaluate": (1400, 2045), "promote": (3450, 1)}


def run_script(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "AGENTKILN_MLFLOW_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID")}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    pytest.skip("no model name in /proc/cpuinfo")


@pytest.fixture(scope="module")
def run_repo(tmp_path_factory):
    """A git repository with a dvc.lock and the MLflow store a finished pipeline run leaves (mlflow.db)."""
    repo = tmp_path_factory.mktemp("repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("x\n")
    subprocess.run(["git", "-C", str(repo), "add", "README.md"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    lock = {"schema": "2.0", "stages": {
        "sft": {"cmd": "python -m flows.sft",
                "params": {"params.yaml": {"seed": 0, "sft": {"model": {"source": "scratch"}, "epochs": 10},
                                           "torch_threads": 3}}},
        "rl@main": {"cmd": "python -m flows.rl main", "params": {"params.yaml": {"torch_threads": 3}}}}}
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock))

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.create_experiment("agentkiln")
    tags = {"agentkiln.stage": "pipeline", "mlflow.source.git.commit": head, "agentkiln.host": socket.gethostname()}
    parent = client.create_run(exp, start_time=T0, tags=tags, run_name="pipeline")
    pid = parent.info.run_id
    for name, (offset, seconds) in STAGES.items():
        child = client.create_run(exp, start_time=T0 + 1000 * offset, run_name=name,
                                  tags={"agentkiln.stage": name, "mlflow.parentRunId": pid})
        if name == "sft":
            client.log_param(child.info.run_id, "model.source", "scratch")
            client.log_param(child.info.run_id, "epochs", "10")
        client.set_terminated(child.info.run_id, end_time=T0 + 1000 * (offset + seconds))
    for key, value in {"base/test": 0.0, "sft/test": 0.7, "rl/test": 0.76875, "distilled/test": 0.5625,
                       "random/test": 0.0, "sft/ood": 0.1}.items():
        client.log_metric(pid, key, value, timestamp=T0)
    client.set_terminated(pid, end_time=T0 + 3460_000)
    # a later pipeline run that never finished: the log takes the last *finished* one
    client.create_run(exp, start_time=T0 + 4000_000, tags={"agentkiln.stage": "pipeline"}, run_name="pipeline")
    # an experiment whose only pipeline run is still running
    other = client.create_experiment("unfinished")
    client.create_run(other, start_time=T0, tags={"agentkiln.stage": "pipeline"}, run_name="pipeline")
    return repo, head, pid


def test_the_row_of_a_finished_run_from_its_mlflow_runs_and_dvc_lock(run_repo, tmp_path):
    repo, head, pid = run_repo
    out = tmp_path / "runs.md"
    store = (repo / "mlflow.db").read_bytes()
    res = run_script("--repo", repo, "--out", out, "--note", "fresh clone")
    assert res.returncode == 0, res.stderr
    assert (repo / "mlflow.db").read_bytes() == store and sorted(p.name for p in repo.iterdir()) == [
        ".git", "README.md", "dvc.lock", "mlflow.db"]  # read from a snapshot: nothing written into the run's repo
    rows = [line for line in out.read_text().splitlines() if line.startswith(f"| 2026-12-02 | {head[:7]} |")]
    assert len(rows) == 1, out.read_text()
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells == ["2026-12-02", head[:7], pid[:8], "scratch", f"{cpu_name()}, {os.cpu_count()} cores", "3",
                     "1:40", "0:21", "6:08", "8:28", "5:50", "34:05", "57:40",
                     "0.0%", "70.0%", "76.9%", "56.2%", "fresh clone"]
    lines = out.read_text().splitlines()
    header = [c.strip() for c in lines[lines.index(rows[0]) - 2].strip("|").split("|")]
    assert header[6] == "synthesize" and header[14] == "test: sft" and len(header) == len(cells)

    # the same run again: its row is replaced, other rows stay
    old = "| 2026-11-29 | abcdef1 | - | scratch | AMD EPYC, 2 cores | 2 | - | - | - | - | - | - | 8:16 | - | 58.8% | 63.1% | 58.1% | (from the README) |"
    out.write_text(out.read_text().replace(rows[0], old + "\n" + rows[0]))
    res = run_script("--repo", repo, "--out", out, "--note", "fresh clone, again", "--cpu", "Test CPU | 2 cores")
    assert res.returncode == 0, res.stderr
    assert "replaced" in res.stdout
    text = out.read_text()
    assert old in text and text.count(pid[:8]) == 1
    assert "| Test CPU \\| 2 cores | 3 |" in text and "fresh clone, again |" in text


def test_a_dvc_lock_of_another_run_is_not_read_for_its_threads(run_repo, tmp_path):
    repo, _, _ = run_repo
    other = tmp_path / "repo"
    other.mkdir()
    (other / "mlflow.db").write_bytes((repo / "mlflow.db").read_bytes())
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    lock["stages"]["sft"]["params"]["params.yaml"]["sft"]["model"]["source"] = "smollm2-135m-instruct"
    (other / "dvc.lock").write_text(yaml.safe_dump(lock))
    res = run_script("--repo", other, "--out", tmp_path / "runs.md")
    assert res.returncode == 2
    assert "dvc.lock is not this run's (sft.model.source" in res.stderr and "--threads" in res.stderr
    assert run_script("--repo", other, "--out", tmp_path / "runs.md", "--threads", "2").returncode == 0


def test_a_missing_store_or_run_is_one_line_with_the_next_step(run_repo, tmp_path):
    res = run_script("--repo", tmp_path, "--out", tmp_path / "runs.md")
    assert res.returncode == 2
    assert f"no MLflow store at {tmp_path.resolve() / 'mlflow.db'}" in res.stderr
    assert "bash scripts/run_pipeline.sh" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs.md").exists()

    repo, _, _ = run_repo
    res = run_script("--repo", repo, "--out", tmp_path / "runs.md", "--experiment", "unfinished")
    assert res.returncode == 2
    assert "no finished pipeline run in experiment 'unfinished'" in res.stderr and "RUNNING" in res.stderr
    assert "Traceback" not in res.stderr
