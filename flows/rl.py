"""Stage `rl`: GRPO + PPO-clip on the RL pool, starting from (and KL-anchored to) the SFT policy."""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from flows._stage import run_flow, stage_context, write_json
from tasks.stages import rl_task


@flow(name="rl", log_prints=True)
def rl_flow(params: Params) -> dict:
    with stage_context("rl", params, params.rl.model_dump()):
        metrics = rl_task(
            params, paths.TASKS, paths.SFT_MODEL, paths.RL_MODEL, paths.REPORTS / "rl_curve.csv", log=tracking.log_metrics
        )
        tracking.log_metrics(metrics)
        write_json(paths.REPORTS / "rl_metrics.json", metrics)
    print(f"RL pool success: {metrics['pool_success_before']:.3f} -> {metrics['pool_success_after']:.3f}")
    return metrics


if __name__ == "__main__":
    run_flow(rl_flow)
