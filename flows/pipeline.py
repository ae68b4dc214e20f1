"""The whole pipeline: `dvc repro` (DVC decides what is stale), then promotion.

    python -m flows.pipeline                                # run once
    python -m flows.pipeline -S sft.epochs=2 -S seed=1      # with overrides (`dvc exp run --set-param`)
    python -m flows.pipeline --serve --cron "0 3 * * *"     # serve on a schedule (needs a Prefect server)
    python -m flows.pipeline --pool agentkiln --cron "0 3 * * *"   # deploy to a work pool, for
                                                            # `prefect worker start --pool agentkiln`
Settings come from params.yaml; `agentkiln run` is the same command.
"""

# No `from __future__ import annotations` here: Prefect validates a deployment's parameters against
# the flow's signature at run time, and a string annotation leaves the types undefined for it.
import argparse
import os
import subprocess
import sys
from pathlib import Path

from prefect import flow, runtime
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists
from prefect.settings import PREFECT_API_URL

from agentkiln import lifecycle, tracking
from agentkiln.relay import Relay
from agentkiln.config import ParamsError, load_params
from agentkiln.errors import UserError
from agentkiln.stages.summary import pipeline_metrics, pipeline_summary
from flows._stage import PARENT_FLOW_RUN_ENV, crash_unfinished_stage_runs, publish, run_flow
from flows.promote import promote_flow

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = "agentkiln-scheduled"


def dvc(args: list[str]) -> None:
    """Run DVC in its own process group (it and its stage die with this process: on SIGTERM or Ctrl-C
    the group gets SIGTERM, then SIGKILL) and relay its output line by line to this flow's log."""
    env = dict(os.environ)
    # Stage commands say `python`: make it this interpreter even when the venv is not activated.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # Stage flows report to this flow's Prefect API (a temporary server unless PREFECT_API_URL is
    # set) instead of each starting a temporary server of its own (~12 s each), as subflows of this run.
    with get_client(sync_client=True) as client:
        env["PREFECT_API_URL"] = str(client.api_url)
    if runtime.flow_run.id:
        env[PARENT_FLOW_RUN_ENV] = str(runtime.flow_run.id)
    env["PYTHONUNBUFFERED"] = "1"
    # progress bars thinned to their first and last lines (and one every 30 s): agentkiln.relay
    try:
        rc = lifecycle.run_group(lifecycle.child_argv("dvc", args), env=env, stdin=subprocess.DEVNULL, on_line=Relay(print))
    except BaseException as e:  # stopped (Ctrl-C, SIGTERM): DVC's group is gone, perhaps before a stage said so
        if runtime.flow_run.id:
            ended = crash_unfinished_stage_runs(str(runtime.flow_run.id), f"the pipeline was stopped ({e or type(e).__name__})")
            if ended:  # their processes could not say so themselves
                print(f"agentkiln: marked crashed in Prefect: {', '.join(ended)}", file=sys.stderr)
        raise
    if rc != 0:
        raise StageFailed(f"`dvc {args[0]}` stopped with exit status {rc}: the failing stage's error is above")


class StageFailed(UserError):
    """A stage failed under DVC; it printed its own error (relayed above), not worth a traceback here."""

    exit_status = 1


@flow(name="agentkiln-pipeline", log_prints=True,
      description="synthesize -> sft -> rl -> distill -> evaluate (dvc repro), then promotion. Settings come "
                  "from params.yaml; `overrides` (key=value) change them for this run the DVC way (dvc exp run -S).")
def pipeline_flow(force: bool = False, overrides: list[str] | None = None) -> dict:
    """`force`: re-run every stage even when DVC has it cached. `overrides`: `key=value` settings of
    params.yaml for this run (`dvc exp run --set-param`), validated before any stage starts."""
    overrides = list(overrides or [])
    load_params(overrides=overrides)  # a bad override or params.yaml stops the run here, naming the key
    tracking.setup()
    with tracking.pipeline_run(tags={"overrides": " ".join(overrides)} if overrides else None):
        if overrides:
            dvc(["exp", "run", *(["--force"] if force else []), *[a for o in overrides for a in ("--set-param", o)]])
        else:
            dvc(["repro", *(["--force"] if force else [])])
        params = load_params()  # params.yaml as the stages saw it (dvc exp run wrote the overrides)
        result = promote_flow(params)
        # the parent run carries the headline numbers: two pipelines compare at the experiment's top level
        tracking.log_metrics(pipeline_metrics(ROOT, params.rl.final))
    publish("pipeline", {k: v for k, v in result.items() if k in ("candidate", "version", "score", "promoted", "reason")})
    print("\n".join(pipeline_summary(ROOT, params.rl.final)))
    return result


def deploy_to_pool(pool: str, cron: str, parameters: dict) -> None:
    """A deployment of this project's pipeline on a process work pool (created if missing); a worker
    (`prefect worker start --pool NAME`) runs each scheduled run in this directory."""
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
    remote = flow.from_source(str(ROOT), entrypoint="flows/pipeline.py:pipeline_flow")
    remote.deploy(name=DEPLOYMENT, work_pool_name=pool, cron=cron, parameters=parameters,
                  job_variables={"working_dir": str(ROOT)})
    print(f"deployed agentkiln-pipeline/{DEPLOYMENT} to work pool {pool!r} on {cron!r}; "
          f"start a worker: prefect worker start --pool {pool}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="re-run every stage even if DVC has it cached")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params.yaml setting for this run (repeatable), e.g. -S sft.epochs=2")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--serve", action="store_true", help="serve as a Prefect deployment on --cron (stays in the foreground)")
    mode.add_argument("--pool", metavar="NAME", help="deploy to Prefect work pool NAME on --cron, for a worker to run")
    ap.add_argument("--cron", default="0 3 * * *", help="schedule for --serve / --pool (default: daily 03:00)")
    args = ap.parse_args()
    try:
        load_params(overrides=args.overrides)
    except ParamsError as e:
        print(f"agentkiln: {e}", file=sys.stderr)
        sys.exit(2)
    if (args.serve or args.pool) and not PREFECT_API_URL.value():
        # Prefect would serve on a temporary server that has no scheduler: a schedule that never runs.
        print("agentkiln: a schedule needs a long-lived Prefect server: start one (`agentkiln ui` or "
              "`prefect server start`) and export PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
        sys.exit(2)
    parameters = {"force": args.force, "overrides": args.overrides}
    if args.serve:
        pipeline_flow.serve(name=DEPLOYMENT, cron=args.cron, parameters=parameters)
    elif args.pool:
        deploy_to_pool(args.pool, args.cron, parameters)
    else:
        run_flow(lambda p: pipeline_flow(force=args.force, overrides=args.overrides))


if __name__ == "__main__":
    main()
