"""What every stage flow shares: validate params before any work, seed, track in MLflow."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

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


def run_flow(flow: Callable[[Params], object]) -> None:
    """CLI entry: refuse bad params.yaml with a clear message before Prefect or torch start work."""
    try:
        params = load_params()
    except ParamsError as e:
        print(f"agentkiln: {e}", file=sys.stderr)
        print("Fix params.yaml and run again (dvc repro).", file=sys.stderr)
        sys.exit(2)
    flow(params)
