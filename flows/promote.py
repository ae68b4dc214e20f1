"""Promotion (not a DVC stage: a cached repro would skip a side effect). Registers the best
candidate as `challenger` and moves `champion` only when the pure gate says so."""

from prefect import flow

from agentkiln import paths
from agentkiln.config import Params
from agentkiln.stages.promote import run_promote
from agentkiln.tracking import repo_root
from flows._stage import publish, run_flow, stage_context, write_json


@flow(name="promote", log_prints=True)
def promote_flow(params: Params) -> dict:
    with stage_context("promote", params, params.promote.model_dump()):
        result = run_promote(params, repo_root(), paths.TASKS, paths.REPORTS, paths.model_dirs(params))
    write_json(paths.REPORTS / "promotion.json", result)
    publish("promote", result)
    print(f"promotion: {result['reason']}")
    return result


if __name__ == "__main__":
    run_flow(promote_flow, __doc__)
