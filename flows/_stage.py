"""What every stage flow shares: validate params before any work, seed, track in MLflow, stop
cleanly on SIGTERM / Ctrl-C leaving no process behind (agentkiln.lifecycle)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import flows
from agentkiln import tracking
from agentkiln.config import Params, ParamsError, load_params
from agentkiln.stages.common import seed_everything


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


def run_flow(flow: Callable[[Params], object], doc: str | None = None) -> None:
    """CLI entry: refuse bad params.yaml with a clear message before Prefect or torch start work.
    With `doc` (the flow module's docstring) the command line is parsed first, so `--help` prints
    it and exits, and a stray argument is an error, before anything starts.

    SIGTERM / SIGHUP / Ctrl-C stop the flow with an exception (cleanup runs, exit status 128 +
    signal); Prefect's temporary server runs as a child that dies with this process; a stage run by
    `dvc repro` also dies with DVC; temporary files live in a directory of the run, removed at exit;
    a watchdog process stops whatever the run started should the run itself be SIGKILLed."""
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
        sys.exit(2)
    try:
        lifecycle.start_prefect_server()
        flow(params)
    except lifecycle.Terminated as e:
        print(f"agentkiln: {e}; stopped cleanly", file=sys.stderr)
        raise
    except KeyboardInterrupt:
        lifecycle.note_interrupt()
        print("agentkiln: interrupted (Ctrl-C); stopped cleanly", file=sys.stderr)
        sys.exit(130)
