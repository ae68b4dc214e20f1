"""Schedules that run, for real: a long-lived Prefect server on a loopback port, the pipeline served
with a cron schedule (`python -m flows.pipeline --serve`), and deployed to a process work pool
executed by `prefect worker start` (`--pool`). The server must list the upcoming scheduled runs; a
triggered run must complete on tiny params with the stages as its subflows, its log lines (DVC's
output) and the stages' markdown artifacts. A pipeline stopped by Ctrl-C or SIGTERM mid-stage leaves
no flow run RUNNING.

AGENTKILN_SAVE_SCREENSHOT=1 also screenshots the deployment page (upcoming runs) and the completed
run (its subflows) in headless Chromium, into docs/images/."""

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

from agentkiln.registry import ui
from agentkiln.servers import stop_process
from agentkiln.services import PrefectServer
from tests.conftest import copy_worktree, merge

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = "agentkiln-pipeline/agentkiln-scheduled"
STAGES = {"synthesize", "sft", "rl", "distill", "evaluate", "promote"}
TINY = {
    "synthesize": {"workers": 1, "splits": {
        "sft": {"n_tasks": 4, "seed": 11, "mix": {"coin_easy": 1.0, "frozenlake_easy": 1.0}},
        "rl": {"n_tasks": 2, "seed": 12, "mix": {"frozenlake_easy": 1.0}},
        "test": {"n_tasks": 3, "seed": 13, "mix": {"coin_easy": 1.0, "frozenlake_easy": 1.0}},
        "ood": {"n_tasks": 1, "seed": 14, "mix": {"sokoban_easy": 1.0}},
        "val": {"n_tasks": 1, "seed": 15, "mix": {"frozenlake_easy": 1.0}}}},
    "sft": {"epochs": 1, "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                                   "vocab_size": 512}},
    "rl": {"defaults": {"iterations": 1, "tasks_per_iter": 2, "group_size": 2, "max_turns": 4},
           "stages": {"main": {"init": "sft"}}},  # the default stage's mix names types this pool lacks
    "distill": {"epochs": 1, "samples_per_task": 1, "max_turns": 4,
                "student": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}},
    "evaluate": {"max_turns": 4, "pass_k": {"samples": 1, "policies": ["sft"]}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = PrefectServer(home=tmp_path_factory.mktemp("prefect_home"))
    try:
        srv.wait()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, server):
    dst = copy_worktree(tmp_path_factory.mktemp("schedule") / "agentkiln")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, PREFECT_API_URL=server.api_url, MLFLOW_TRACKING_URI=f"sqlite:///{dst / 'mlflow.db'}",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    env.pop("AGENTKILN_PARENT_RUN_ID", None)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for cmd in (["git", "init", "-q"], [*git, "add", "-A"], [*git, "commit", "-qm", "snapshot"]):
        subprocess.run(cmd, cwd=dst, env=env, check=True, capture_output=True)
    return dst, env


def client(server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}):
        return get_client(sync_client=True)


def wait_for(what, fn, timeout=120.0, proc=None):
    deadline = time.monotonic() + timeout
    while (value := fn()) is None:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}:\n{proc.log.read_text()[-4000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(1)
    return value


def background(argv, repo, env, log: Path):
    with open(log, "wb") as f:
        # SIGINT as at a terminal: a shell's background job (e.g. a CI runner's) inherits it ignored,
        # and Python then never turns Ctrl-C into KeyboardInterrupt
        proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.log = log
    return proc


def run_to_the_end(c, deployment_id, timeout=600.0):
    flow_run = c.create_flow_run_from_deployment(deployment_id)  # a run now, next to the scheduled ones

    def final():
        fr = c.read_flow_run(flow_run.id)
        return fr if fr.state and fr.state.is_final() else None

    return wait_for("the triggered run to finish", final, timeout)


def upcoming(c, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter

    runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment_id]}),
                            flow_run_filter=FlowRunFilter(state={"type": {"any_": ["SCHEDULED"]}}))
    return runs or None


def test_served_schedule_lists_upcoming_runs_and_a_triggered_run_completes_with_subflows(server, repo, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter

    dst, env = repo
    serve = background([sys.executable, "-m", "flows.pipeline", "--serve", "--cron", "0 3 * * *"], dst, env,
                       tmp_path / "serve.log")
    try:
        with client(server) as c:
            deployment = wait_for("the served deployment", lambda: next(
                (d for d in c.read_deployments() if d.name == "agentkiln-scheduled"), None), 120, serve)
            assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
            assert set(deployment.parameter_openapi_schema["properties"]) == {"force", "overrides"}
            scheduled = wait_for("scheduled runs", lambda: upcoming(c, deployment.id), 120)
            assert all(r.expected_start_time.hour == 3 for r in scheduled)

            done = run_to_the_end(c, deployment.id)
            assert done.state.is_completed(), (done.state, (tmp_path / "serve.log").read_text()[-5000:])
            children = c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [done.id]}))
            names = {c.read_flow(r.flow_id).name for r in children}
            assert STAGES <= names, names
            assert all(r.state.is_completed() for r in children)
            logs = c.read_logs(LogFilter(flow_run_id={"any_": [done.id]}))
            assert any("Running stage 'sft'" in log.message for log in logs), [log.message for log in logs][:20]
            keys = {a.key for a in c.read_artifacts()}
            assert {"synthesize-metrics", "sft-metrics", "rl-main-metrics", "distill-metrics", "evaluation",
                    "promote-metrics", "pipeline-metrics"} <= keys, keys
            shots(server, deployment.id, done.id, tmp_path)
    finally:
        stop_process(serve)


def shots(server, deployment_id, flow_run_id, tmp_path):
    """The docs' screenshots, on demand (AGENTKILN_SAVE_SCREENSHOT=1): ~40 s of Chromium."""
    if not os.environ.get("AGENTKILN_SAVE_SCREENSHOT"):
        return
    pages = {"prefect_deployment.png": f"{server.ui_url}/deployments/deployment/{deployment_id}?tab=Upcoming",
             "prefect_run.png": f"{server.ui_url}/runs/flow-run/{flow_run_id}"}
    for name, url in pages.items():
        png = ui.screenshot(url, tmp_path / name, width=1500, height=1000, virtual_time_ms=20000)
        assert png.stat().st_size > 30_000
        shutil.copyfile(png, ROOT / "docs" / "images" / name)


def test_work_pool_worker_runs_the_deployment(server, repo, tmp_path):
    dst, env = repo
    deploy = subprocess.run([sys.executable, "-m", "flows.pipeline", "--pool", "agentkiln-test", "--cron", "0 4 * * *"],
                            cwd=dst, env=env, capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    worker = background([sys.executable, "-m", "prefect", "worker", "start", "--pool", "agentkiln-test"], dst, env,
                        tmp_path / "worker.log")
    try:
        with client(server) as c:
            deployment = c.read_deployment_by_name(DEPLOYMENT)
            assert deployment.work_pool_name == "agentkiln-test"
            wait_for("scheduled runs", lambda: upcoming(c, deployment.id), 120)
            done = run_to_the_end(c, deployment.id)  # DVC has every stage cached by now: promotion only
            assert done.state.is_completed(), (done.state, (tmp_path / "worker.log").read_text()[-5000:])
    finally:
        stop_process(worker)


def stage_processes(pid: int) -> list[int]:
    """The stage processes (`python -m flows.<stage>`) under process `pid`."""
    from agentkiln.lifecycle import children

    found = []
    for p in children(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(b"flows.") and a != b"flows.pipeline" for a in argv):
            found.append(p)
    return found


@pytest.mark.parametrize("sig,frozen", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["ctrl-c", "sigterm", "ctrl-c-stage-frozen"])
def test_a_stopped_pipeline_leaves_no_flow_run_running(server, repo, tmp_path, sig, frozen):
    """Ctrl-C (SIGINT) or `kill` (SIGTERM) in the middle of a stage: the pipeline run, the stage's
    subflow run and the task run linking them end in a final state (CRASHED), none stays RUNNING.
    `frozen`: the stage process is SIGSTOPped first, so it cannot report its own crash (as one stopped
    before Prefect's handlers are in place, or SIGKILLed after its grace period): the pipeline marks
    its run crashed once DVC's group is gone."""
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

    dst, env = repo
    stopped = []
    with client(server) as c:
        before = {r.id for r in c.read_flow_runs(limit=200)}
        proc = background([sys.executable, "-m", "flows.pipeline", "--force"], dst, env, tmp_path / "stopped.log")
        try:
            def a_stage_running():
                runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(state={"type": {"any_": ["RUNNING"]}}))
                new = [r for r in runs if r.id not in before]
                return new if any(r.parent_task_run_id for r in new) else None

            running = wait_for("a stage running under the pipeline", a_stage_running, 120, proc)
            if frozen:
                stopped = wait_for("the stage's process", lambda: stage_processes(proc.pid) or None, 30, proc)
                for p in stopped:
                    os.kill(p, signal.SIGSTOP)
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            stop_process(proc)
            for p in stopped:  # SIGKILLed by the pipeline already, unless the test failed before
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert proc.returncode == (130 if sig == signal.SIGINT else 128 + signal.SIGTERM), proc.log.read_text()[-3000:]
        pipeline = next(r for r in running if not r.parent_task_run_id)
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id for r in running]}))
        tasks = c.read_task_runs(task_run_filter=TaskRunFilter(id={"any_": [r.parent_task_run_id for r in running
                                                                             if r.parent_task_run_id]}))
        assert {r.name: r.state.type.value for r in runs} == {r.name: "CRASHED" for r in runs}, (pipeline.name, proc.log.read_text()[-3000:])
        assert all(t.state.is_final() for t in tasks), [(t.name, t.state) for t in tasks]
        if frozen:  # the pipeline, not the frozen stage, ended the stage's run, saying why
            stages = [r for r in runs if r.parent_task_run_id]
            assert stages and all("the pipeline was stopped" in (r.state.message or "") for r in stages), \
                [(r.name, r.state.message) for r in stages]


def test_a_schedule_without_a_prefect_server_is_refused(tmp_path):
    """Prefect would serve on a temporary server, which has no scheduler: no run would ever start."""
    env = dict(os.environ, PREFECT_HOME=str(tmp_path))
    env.pop("PREFECT_API_URL", None)
    for mode in (["--serve"], ["--pool", "agentkiln-test"]):
        r = subprocess.run([sys.executable, "-m", "flows.pipeline", *mode, "--cron", "0 3 * * *"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "PREFECT_API_URL" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert not list(tmp_path.iterdir()), "nothing may be created before the refusal"
