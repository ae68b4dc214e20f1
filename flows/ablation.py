"""The RL ablation (params.yaml `ablation`): every arm x seed from the same starting policy at the
same rollout budget, evaluated on a frozen panel; writes reports/ablation.{md,json,png}.

    dvc repro sft && python -m flows.ablation        # needs data/tasks and the starting model
"""

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from agentkiln.stages.ablation import run_ablation
from flows._stage import run_flow, stage_context


@flow(name="rl-ablation", log_prints=True)
def ablation_flow(params: Params) -> dict:
    missing = [p for p in (paths.TASKS, paths.model_dir(params.ablation.init)) if not p.exists()]
    if missing:
        raise SystemExit(f"ablation: {', '.join(map(str, missing))} missing: run `dvc repro sft` first")

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
    run_flow(ablation_flow, __doc__)
