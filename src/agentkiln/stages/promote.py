"""Promotion: register the best candidate as `challenger`; make it `champion` only if it beats the
current champion on the same frozen panel by the margin. The decision itself is the pure
`agentkiln.registry.promotion.decide`; this module performs the registry side effects.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlflow

from agentkiln.config import Params
from agentkiln.registry.lineage import lineage_tags
from agentkiln.registry.model_registry import champion, promote, register_candidate
from agentkiln.registry.promotion import decide, pick_candidate


def panel_id(tasks_dir: Path) -> str:
    """Identity of the frozen test panel: scores on different panels are never compared."""
    return hashlib.sha256((Path(tasks_dir) / "test" / "manifest.json").read_bytes()).hexdigest()[:16]


def run_promote(params: Params, root: Path, tasks_dir: Path, reports_dir: Path, model_dirs: dict[str, Path]) -> dict:
    p = params.promote
    metrics_file = Path(reports_dir) / "metrics.json"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{metrics_file}: missing; run the pipeline (dvc repro) before promotion")
    metrics = json.loads(metrics_file.read_text())
    name = pick_candidate(metrics, list(p.candidates), p.metric)
    score = float(metrics[name][p.metric])
    panel = panel_id(tasks_dir)
    run = mlflow.active_run()
    tags = lineage_tags(
        root,
        {
            "candidate": name,
            "eval.panel": panel,
            f"eval.{p.metric}": f"{score:.4f}",
            "eval.ci_low": f"{metrics[name]['ci_low']:.4f}",
            "eval.ci_high": f"{metrics[name]['ci_high']:.4f}",
            "mlflow_run": run.info.run_id if run else "none",
        },
    )
    version = register_candidate(Path(model_dirs[name]), p.model_name, tags, {p.metric: score})
    current = champion(p.model_name)
    champ_score = None
    if current is not None:
        champ_version, champ_tags = current
        if champ_tags.get("eval.panel") == panel and f"eval.{p.metric}" in champ_tags:
            champ_score = float(champ_tags[f"eval.{p.metric}"])
        else:
            # A champion scored on another panel is not comparable: this walking version refuses to
            # compare and keeps it, saying so (re-evaluating it on this panel is the fix).
            return {
                "candidate": name, "version": version, "promoted": False, "champion_version": champ_version,
                "reason": f"champion v{champ_version} was scored on another panel; re-evaluate it on {panel}",
            }
    decision = decide(score, champ_score, p.margin)
    if decision.promote:
        promote(p.model_name, version)
    return {
        "candidate": name,
        "version": version,
        "score": score,
        "champion_score": champ_score,
        "promoted": decision.promote,
        "reason": decision.reason,
    }
