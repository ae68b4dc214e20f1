"""Per-stage wall time of a pipeline run, read back from the MLflow store (no re-run).

Every stage of `python -m flows.pipeline` is an MLflow child run of one `pipeline` parent run; their
start and end times are the stages' wall times (the gaps are process start-up, DVC and Prefect).

    python bench/stage_times.py                                  # the latest pipeline run in ./mlflow.db
    python bench/stage_times.py --out bench/results/stage_times.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlflow

from agentkiln import tracking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/stage_times.json")
    args = ap.parse_args()
    tracking.setup()
    runs = mlflow.search_runs(experiment_names=[tracking.DEFAULT_EXPERIMENT], output_format="list")
    parents = sorted((r for r in runs if r.info.run_name == "pipeline"), key=lambda r: r.info.start_time)
    if not parents:
        raise SystemExit("no pipeline run in the MLflow store: run `bash scripts/run_pipeline.sh` first")
    parent = parents[-1]
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                      key=lambda r: r.info.start_time)
    stages = {r.info.run_name: round((r.info.end_time - r.info.start_time) / 1000, 1) for r in children if r.info.end_time}
    total = round(((parent.info.end_time or children[-1].info.end_time) - parent.info.start_time) / 1000, 1)
    result = {"pipeline_run": parent.info.run_id, "machine": platform.processor() or platform.machine(),
              "stages_s": stages, "stages_sum_s": round(sum(stages.values()), 1), "pipeline_s": total,
              "overhead_s": round(total - sum(stages.values()), 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
