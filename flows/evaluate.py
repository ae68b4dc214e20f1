"""Stage `evaluate`: every policy and baseline on the frozen panels -> reports/metrics.json,
outcomes.json, comparisons.json, eval.md, eval.html and plots (logged to MLflow too)."""

import mlflow
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from agentkiln import paths, tracking
from agentkiln.config import PANELS, Params
from flows._stage import needs, run_flow, stage_context
from tasks.evaluate import evaluate_task


REPORT_FILES = ("eval.md", "eval.html", "trajectories.html", "metrics.json", "headline.json", "outcomes.json", "comparisons.json", "success.png",
                "passk.png", "curves.png")


@flow(name="evaluate", log_prints=True)
def evaluate_flow(params: Params) -> dict:
    with stage_context("evaluate", params, params.evaluate.model_dump()):
        metrics = evaluate_task(params, paths.TASKS, paths.model_dirs(params), paths.REPORTS, paths.rl_curves(params))
        for name, m in metrics.items():
            tracking.log_metrics({f"{name}/{k}": v for k, v in m.items()})
            tracking.log_metrics({f"{name}/family/{f}/success": x["success"] for f, x in m["by_family"].items()})
            tracking.log_metrics({f"{name}/pass_at_{k}": v for k, v in m.get("pass_at_k", {}).items()})
            tracking.log_metrics({f"{name}/{panel}/success": m[panel]["success"] for panel in PANELS if panel in m})
        for split in PANELS:
            if (paths.TASKS / split).is_dir():
                tracking.log_split(paths.TASKS / split, context="evaluation")
        for name in REPORT_FILES:
            mlflow.log_artifact(str(paths.REPORTS / name))
    create_markdown_artifact((paths.REPORTS / "eval.md").read_text(), key="evaluation")
    print((paths.REPORTS / "eval.md").read_text())
    return metrics


if __name__ == "__main__":
    # only the models the stage plays (models/base where evaluate.policies names base)
    run_flow(evaluate_flow, __doc__, check=lambda p: [needs(d, paths.stage_writing(n, p))
                                                     for n, d in paths.model_dirs(p).items()
                                                     if n in p.evaluate.policies])
