"""Stage `sft`: the cold-start policy, trained on expert walkthroughs (action tokens only)."""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.collected import split_digest
from agentkiln.config import Params
from agentkiln.registry.model_registry import log_policy
from flows._stage import needs, publish, run_flow, stage_context, write_json
from tasks.sft import sft_task


@flow(name="sft", log_prints=True)
def sft_flow(params: Params) -> dict:
    def outputs(metrics: dict) -> None:  # before the stage removes its checkpoint: a failure here keeps it
        tracking.log_metrics(metrics)
        write_json(paths.REPORTS / "sft_metrics.json", metrics)
        tracking.log_split(paths.TASKS / "sft")
        if collected := params.sft.data.collected:
            tracking.log_collected(collected, split_digest(collected))
        log_policy(paths.SFT_MODEL)
        publish("sft", metrics)

    with stage_context("sft", params, params.sft.model_dump()):
        return sft_task(params, paths.TASKS, paths.SFT_MODEL, log=tracking.log_metrics,
                        ckpt_dir=paths.CHECKPOINTS / "sft", outputs=outputs)


if __name__ == "__main__":
    run_flow(sft_flow, __doc__, check=lambda p: needs(paths.TASKS / "sft", "synthesize"))
