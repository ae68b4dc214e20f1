"""Stage `synthesize`: TextWorld games -> seeded, disjoint sft / rl / test splits with manifests."""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from flows._stage import run_flow, stage_context
from tasks.stages import synthesize_task


@flow(name="synthesize", log_prints=True)
def synthesize_flow(params: Params) -> dict:
    with stage_context("synthesize", params, params.synthesize.model_dump()):
        summary = synthesize_task(params.synthesize, paths.TASKS)
        tracking.log_metrics(summary)
    return summary


if __name__ == "__main__":
    run_flow(synthesize_flow)
