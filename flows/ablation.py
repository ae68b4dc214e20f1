"""The RL ablation (params.yaml `ablation`): every arm x seed from the same starting policy at the
same rollout budget, evaluated on a frozen panel; writes reports/ablation.{md,json,png}.

    dvc repro sft && python -m flows.ablation        # needs data/tasks and the starting model
"""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from agentkiln.stages.ablation import run_ablation
from flows._stage import needs, run_flow, stage_context


@flow(name="rl-ablation", log_prints=True)
def ablation_flow(params: Params) -> dict:
    def log_run(arm, seed, metrics, curve):
        with tracking.stage_run(f"ablation-{arm}-s{seed}", params={"arm": arm, "seed": seed}):
            for row in curve:
                tracking.log_metrics({k: v for k, v in row.items() if k != "iteration"}, row["iteration"])
            tracking.log_metrics(metrics)

    with stage_context("ablation", params, params.ablation.model_dump()):
        result = run_ablation(params, paths.TASKS, paths.REPORTS, log_run=log_run)
        for name in ("ablation.md", "ablation.json", "ablation.png"):
            tracking.log_artifact(paths.REPORTS / name)
    print((paths.REPORTS / "ablation.md").read_text())
    return result["summary"]


if __name__ == "__main__":
    def check(params: Params) -> None:  # the pool and the starting model, before anything starts
        needs(paths.TASKS / "rl", "synthesize")
        init = params.ablation.init
        needs(paths.model_dir(init), {"distilled": "distill"}.get(init, init.replace("/", "@")))

    run_flow(ablation_flow, __doc__, check=check)
