"""Stage `base`: the model every policy starts from (scratch, a packaged model, a .gguf file or a local
Hugging Face directory: sft.model.source), written to models/base as a saved policy with its agent format."""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from flows._stage import needs, publish, run_flow, stage_context, write_json
from tasks.base import base_task


@flow(name="base", log_prints=True)
def base_flow(params: Params) -> dict:
    with stage_context("base", params, {"model": params.sft.model.model_dump(), "agent": params.sft.agent.model_dump()}):
        metrics = base_task(params, paths.TASKS, paths.BASE_MODEL)
        tracking.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        write_json(paths.REPORTS / "base_metrics.json", metrics)
        publish("base", metrics)
        print(f"base: {metrics['architecture']} of {metrics['n_params']:,} parameters ({metrics['source']}) "
              f"-> {paths.BASE_MODEL}")
        return metrics


if __name__ == "__main__":
    run_flow(base_flow, __doc__, check=lambda p: needs(paths.TASKS / "sft", "synthesize"))
