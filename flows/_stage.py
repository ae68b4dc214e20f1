"""What every stage flow shares: validate params before any work, seed, track in MLflow, stop
cleanly on SIGTERM / Ctrl-C leaving no process behind (agentkiln.lifecycle)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from prefect import Flow, Task
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter
from prefect.flow_engine import run_flow as run_prefect_flow
from prefect.states import Completed, Crashed, Failed, Pending, Running

import flows
from agentkiln import tracking
from agentkiln.config import Params, ParamsError, load_params
from agentkiln.errors import UserError
from agentkiln.seeding import seed_everything


# The pipeline's flow run id, exported to the stage processes DVC starts: a stage's flow run then
# appears in the Prefect UI as a subflow of the pipeline run (Prefect links a subflow through a
# task run in the parent, which is what an in-process subflow call creates; here it is made by hand).
PARENT_FLOW_RUN_ENV = "AGENTKILN_PREFECT_PARENT_FLOW_RUN"


def call_flow(flow: Flow, **kwargs):
    """Run `flow(**kwargs)`: as a subflow of the flow run named by AGENTKILN_PREFECT_PARENT_FLOW_RUN
    when the pipeline started this process, else as a top-level flow run."""
    parent = os.environ.get(PARENT_FLOW_RUN_ENV)
    if not parent:
        return flow(**kwargs)
    with get_client(sync_client=True) as client:
        tracker = Task(name=flow.name, fn=flow.fn)
        task_run = client.create_task_run(tracker, flow_run_id=uuid.UUID(parent), dynamic_key=uuid.uuid4().hex,
                                          name=flow.name, state=Running())
        flow_run = client.create_flow_run(flow, parameters=flow.serialize_parameters(kwargs), state=Pending(),
                                          parent_task_run_id=task_run.id)
    ok = False
    try:
        result = run_prefect_flow(flow, flow_run=flow_run, parameters=kwargs)
        ok = True
        return result
    finally:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run.id, Completed() if ok else Failed(), force=True)


def crash_unfinished_stage_runs(parent: str, why: str) -> list[str]:
    """After the pipeline stopped its stage processes (Ctrl-C, SIGTERM): end as CRASHED the stage
    flow runs under flow run `parent`, and the task runs linking them, that are still not final. A
    stage reports its own crash when it can; one stopped before Prefect's handlers were in place, or
    SIGKILLed after its grace period, cannot, and would show RUNNING in the UI for ever. Best effort
    (the run is stopping): returns the names of the runs it ended."""
    ended = []
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [parent]}))
            links = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [parent]}))
            for run in runs:
                if run.state is None or not run.state.is_final():
                    client.set_flow_run_state(run.id, Crashed(message=why), force=True)
                    ended.append(run.name)
            for link in links:
                if link.state is None or not link.state.is_final():
                    client.set_task_run_state(link.id, Crashed(message=why), force=True)
    except Exception as e:  # the server gone too: nothing more to do here
        print(f"agentkiln: could not mark the stopped stages' Prefect runs crashed ({e})", file=sys.stderr)
    return ended


class MissingInput(UserError, FileNotFoundError):
    """An input another stage writes is not there."""


def needs(path: Path, stage: str) -> None:
    """Refuse to start without an input another stage writes, saying which stage to run."""
    if not Path(path).exists():
        raise MissingInput(f"{path} is missing: the {stage} stage writes it; run `agentkiln stage {stage}` "
                           f"(or `dvc repro {stage}`, or `dvc pull` to fetch it from the team's remote) first")


def is_plain(e: BaseException) -> bool:
    """A clear error, said in one line without a traceback: a UserError, or a FileNotFoundError that
    agentkiln raised with its own message (errno None; one from the OS has an errno and may be a bug)."""
    return isinstance(e, UserError) or (isinstance(e, FileNotFoundError) and e.errno is None)


class _PlainErrorsOnce(logging.Filter):
    """For Prefect's console handler: a clear error is logged by every task and flow it passes through,
    with its traceback, then each run's "Finished in state Failed(<the message again>)"; run_flow says
    it once instead. Only the console is spared: the API (Prefect's UI) keeps every line, and the
    runs are recorded Failed with the message."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_plain(exc):
            self.seen = True
            return False
        return not (self.seen and str(record.msg).startswith("Finished in state Failed"))


def quiet_plain_errors() -> None:
    """Install _PlainErrorsOnce on Prefect's console handler (the root logger's, in Prefect's logging config)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _PlainErrorsOnce)
                                                                  for f in handler.filters):
            handler.addFilter(_PlainErrorsOnce())


def publish(stage: str, metrics: dict) -> None:
    """The stage's headline numbers as a markdown table on its Prefect flow run (Artifacts tab)."""
    rows = [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
            for k, v in sorted(metrics.items()) if isinstance(v, (int, float, str, bool))]
    key = "".join(c if c.isalnum() else "-" for c in stage.lower())
    create_markdown_artifact(f"## {stage}\n\n| metric | value |\n|---|---|\n" + "\n".join(rows) + "\n",
                             key=f"{key}-metrics", description=f"{stage}: metrics of this run")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def stage_context(stage: str, params: Params, section: dict):
    """Seed, then open this stage's MLflow run (a child of the pipeline run when there is one)."""
    seed_everything(params.seed, params.torch_threads)
    tracking.setup()
    with tracking.stage_run(stage, params=section, tags={"seed": str(params.seed)}) as run:
        yield run


def run_flow(flow: Flow | Callable[[Params], object], doc: str | None = None,
             check: Callable[[Params], object] | None = None) -> None:
    """CLI entry: refuse bad params.yaml with a clear message before Prefect or torch start work.
    With `doc` (the flow module's docstring) the command line is parsed first, so `--help` prints
    it and exits, and a stray argument is an error, before anything starts.

    SIGTERM / SIGHUP / Ctrl-C stop the flow with an exception (cleanup runs, exit status 128 +
    signal); Prefect's temporary server runs as a child that dies with this process; a stage run by
    `dvc repro` also dies with DVC; temporary files live in a directory of the run, removed at exit;
    a watchdog process stops whatever the run started should the run itself be SIGKILLed.
    `check(params)` validates command-line choices and inputs before anything starts (an RL stage's
    name, the models a stage reads: `needs`): what it raises is reported in one line, exit status 2.
    A clear error inside the flow (`is_plain`) is reported the same way, once, Prefect's tracebacks of
    it left out of the console (they stay in its API, with the flow run recorded Failed)."""
    from agentkiln import lifecycle  # how a run stops, not what it computes: not a stage dependency

    if doc is not None:
        prog = f"python -m flows.{Path(sys.argv[0]).stem}"
        argparse.ArgumentParser(prog=prog, description=doc, epilog="Settings come from params.yaml; "
                                "`dvc repro` runs the stages in order.").parse_args()
    lifecycle.start_watchdog()
    lifecycle.private_tmpdir()  # removed at exit: nothing a child leaves in a temporary directory survives the run
    lifecycle.handle_signals()
    if os.environ.get("DVC_STAGE"):
        lifecycle.die_with_dvc(flows.STARTED_BY)
    try:
        params = load_params()
    except ParamsError as e:
        print(f"agentkiln: {e}", file=sys.stderr)
        print("Fix params.yaml and run again (dvc repro).", file=sys.stderr)
        sys.exit(e.exit_status)
    try:
        if check is not None:
            check(params)
    except (UserError, FileNotFoundError) as e:
        print(f"agentkiln: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_status", 2))
    # Prefect's aiosqlite pool, reset at exit after its temporary server stopped, at times logs a failed
    # rollback with a traceback (seen once in a suite run, under an error that was said plainly): not the
    # user's error, nothing lost, so it does not reach the console
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
    try:
        lifecycle.start_prefect_server()
        quiet_plain_errors()
        call_flow(flow, params=params) if isinstance(flow, Flow) else flow(params)
    except (UserError, FileNotFoundError) as e:  # Prefect recorded the runs Failed; said once, plainly
        if not is_plain(e):
            raise
        print(f"agentkiln: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_status", 2))
    except lifecycle.Terminated as e:
        print(f"agentkiln: {e}; stopped cleanly", file=sys.stderr)
        raise
    except KeyboardInterrupt:
        lifecycle.note_interrupt()
        print("agentkiln: interrupted (Ctrl-C); stopped cleanly", file=sys.stderr)
        sys.exit(130)
