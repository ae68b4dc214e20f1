"""Stage `distill`: a smaller student trained on the RL teacher's successful episodes."""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from agentkiln.registry.model_registry import log_policy
from flows._stage import needs, publish, run_flow, stage_context, write_json
from tasks.distill import distill_task


@flow(name="distill", log_prints=True)
def distill_flow(params: Params) -> dict:
    def outputs(metrics: dict) -> None:  # before the stage removes its checkpoint: a failure here keeps it
        tracking.log_metrics(metrics)
        write_json(paths.REPORTS / "distill_metrics.json", metrics)
        tracking.log_split(paths.TASKS / "rl")
        log_policy(paths.DISTILLED_MODEL)
        publish("distill", metrics)

    with stage_context("distill", params, params.distill.model_dump()):
        return distill_task(params, paths.TASKS, paths.model_dirs(params)["rl"], paths.DISTILLED_MODEL,
                            log=tracking.log_metrics, ckpt_dir=paths.CHECKPOINTS / "distill", outputs=outputs)


if __name__ == "__main__":
    run_flow(distill_flow, __doc__, check=lambda p: needs(paths.model_dirs(p)["rl"], f"rl@{p.rl.final}"))
