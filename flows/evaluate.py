"""Stage `evaluate`: every policy on the frozen test panel -> reports/metrics.json, eval.md, plot."""

import mlflow
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from agentkiln import paths, tracking
from agentkiln.config import Params
from flows._stage import run_flow, stage_context
from tasks.stages import evaluate_task


@flow(name="evaluate", log_prints=True)
def evaluate_flow(params: Params) -> dict:
    with stage_context("evaluate", params, params.evaluate.model_dump()):
        metrics = evaluate_task(params, paths.TASKS, paths.model_dirs(params), paths.REPORTS)
        for name, m in metrics.items():
            tracking.log_metrics({f"{name}/{k}": v for k, v in m.items()})
        for name in ("eval.md", "success.png", "metrics.json"):
            mlflow.log_artifact(str(paths.REPORTS / name))
    create_markdown_artifact((paths.REPORTS / "eval.md").read_text(), key="evaluation")
    print((paths.REPORTS / "eval.md").read_text())
    return metrics


if __name__ == "__main__":
    run_flow(evaluate_flow)
