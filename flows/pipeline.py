"""The whole pipeline: `dvc repro` (DVC decides what is stale), then promotion.

    python -m flows.pipeline                     # run once
    python -m flows.pipeline --serve --cron "0 3 * * *"   # serve on a schedule (needs `prefect server start`)
"""

# No `from __future__ import annotations` here: Prefect validates a deployment's parameters against
# the flow's signature at run time, and a string annotation leaves `Params` undefined for it.
import argparse
import os
import subprocess
import sys
from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client

from agentkiln import lifecycle, tracking
from agentkiln.config import Params, load_params
from flows._stage import run_flow
from flows.promote import promote_flow


def dvc_repro(extra: list[str]) -> None:
    env = dict(os.environ)
    # Stage commands say `python`: make it this interpreter even when the venv is not activated.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # Stage flows report to this flow's Prefect API (a temporary server unless PREFECT_API_URL is
    # set) instead of each starting a temporary server of its own (~12 s each).
    with get_client(sync_client=True) as client:
        env["PREFECT_API_URL"] = str(client.api_url)
    # DVC and its stage in a process group of their own, dying with this process: on SIGTERM or
    # Ctrl-C here the group gets SIGTERM and this flow waits until it is gone (then SIGKILL)
    cmd = ["dvc", "repro", *extra]
    rc = lifecycle.run_group(lifecycle.child_argv(cmd[0], cmd[1:]), env=env, stdin=subprocess.DEVNULL)
    if rc != 0:
        raise subprocess.CalledProcessError(rc, [sys.executable, "-m", *cmd])


@flow(name="agentkiln-pipeline", log_prints=True)
def pipeline_flow(params: Params | None = None, force: bool = False) -> dict:
    params = params or load_params()  # validated before any stage starts
    tracking.setup()
    with tracking.pipeline_run(tags={"seed": str(params.seed)}):
        dvc_repro(["--force"] if force else [])
        return promote_flow(params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="re-run every stage even if DVC has it cached")
    ap.add_argument("--serve", action="store_true", help="serve as a Prefect deployment on --cron")
    ap.add_argument("--cron", default="0 3 * * *", help="schedule for --serve (default: daily 03:00)")
    args = ap.parse_args()
    if args.serve:
        load_params()
        pipeline_flow.serve(name="agentkiln-scheduled", cron=args.cron, parameters={"force": args.force})
    else:
        run_flow(lambda p: pipeline_flow(p, force=args.force))


if __name__ == "__main__":
    main()
