"""Stage `synthesize`: a mixture of task families -> seeded, disjoint sft / rl / test / ood splits,
then a Great Expectations checkpoint on the result (HTML data docs in reports/data_docs)."""

from prefect import flow

from agentkiln import fanout, paths, tracking
from agentkiln.config import Params
from flows._stage import publish, run_flow, stage_context
from tasks.synthesize import checkpoint_task, synthesize_task


@flow(name="synthesize", log_prints=True)
def synthesize_flow(params: Params) -> dict:
    with stage_context("synthesize", params, params.synthesize.model_dump()):
        with fanout.session(params.compute.ray):  # workers as Ray tasks when enabled: the same bytes
            summary = synthesize_task(params.synthesize, paths.TASKS)
        tracking.log_metrics(summary)
        publish("synthesize", summary)
        checks = checkpoint_task(params.synthesize, paths.TASKS, paths.DATA_DOCS)
        tracking.log_metrics({"data_checks_evaluated": checks["evaluated"]})
        print(f"data checkpoint: {checks['evaluated']} expectations passed; report: {paths.DATA_DOCS}/index.html")
    return summary


if __name__ == "__main__":
    run_flow(synthesize_flow, __doc__)
