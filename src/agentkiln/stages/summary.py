"""What a pipeline run produced, in a few lines: each stage's headline, the champion, what to open.

Read from the stages' reports (the files dvc.yaml tracks), so a run that DVC served from its cache
says the same as one that trained. `pipeline_metrics` is the handful of numbers the parent MLflow run
"pipeline" carries, so two pipelines compare at the top level of the experiment.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentkiln import paths
from agentkiln.config import OPTIONAL_PANELS
from agentkiln.evaluate.report import headline

POLICIES = ("random", "base", "sft", "rl", "distilled")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def pipeline_metrics(root: Path, final_rl: str) -> dict[str, float]:
    """`dvc metrics show`'s numbers as <policy>/<test | val | ood | test_<family>> (evaluate.report.headline);
    promote/score and promote/promoted; the last RL stage's pool success before and after."""
    metrics = _read(root / paths.REPORTS / "metrics.json")
    out = {f"{policy}/{key}": float(v) for policy, row in headline(metrics, families=True).items() for key, v in row.items()
           if v is not None}
    promotion = _read(root / paths.REPORTS / "promotion.json")
    if promotion.get("score") is not None:
        out["promote/score"] = float(promotion["score"])
    if "promoted" in promotion:
        out["promote/promoted"] = float(bool(promotion["promoted"]))
    rl = _read(root / paths.rl_reports(final_rl) / "metrics.json")
    for key in ("pool_success_before", "pool_success_after"):
        if key in rl:
            out[f"rl/{key}"] = float(rl[key])
    return out


def pipeline_summary(root: Path, final_rl: str) -> list[str]:
    """The lines a finished run ends with."""
    reports = root / paths.REPORTS
    lines = ["agentkiln: the pipeline finished. What it produced:"]
    base = _read(reports / "base_metrics.json")
    if base:
        lines.append(f"  base      models/base: {base.get('architecture', '?')} of {base.get('n_params', 0):,} parameters "
                     f"({base.get('source', '?')})")
    sft = _read(reports / "sft_metrics.json")
    if sft:
        lines.append(f"  sft       models/sft: {sft.get('n_episodes', '?')} episodes, final token accuracy "
                     f"{_pct(sft.get('final_token_acc'))}")
    rl = _read(reports / "rl" / final_rl / "metrics.json")
    if rl:
        lines.append(f"  rl        models/rl/{final_rl}: {rl.get('algorithm', '?')}, {rl.get('episodes', '?')} episodes, "
                     f"pool success {_pct(rl.get('pool_success_before'))} -> {_pct(rl.get('pool_success_after'))}")
    distill = _read(reports / "distill_metrics.json")
    if distill:
        lines.append(f"  distill   models/distilled: a {distill.get('student_params', '?')}-parameter student, "
                     f"{distill.get('n_episodes', '?')} episodes")
    metrics = _read(reports / "metrics.json")
    if metrics:
        parts = []
        for policy in POLICIES:
            m = metrics.get(policy) or {}
            if "success" in m:
                other = [f"{panel} {_pct(m[panel].get('success'))}" for panel in OPTIONAL_PANELS if isinstance(m.get(panel), dict)]
                parts.append(f"{policy} {_pct(m['success'])}" + (f" ({', '.join(other)})" if other else ""))
        lines.append("  evaluate  test panel: " + ", ".join(parts))
    promotion = _read(reports / "promotion.json")
    if promotion:
        verdict = "now champion" if promotion.get("promoted") else "not promoted"
        lines.append(f"  promote   {promotion.get('candidate', '?')} (version {promotion.get('version', '?')}, score "
                     f"{_pct(promotion.get('score'))}): {verdict}: {promotion.get('reason', '')}")
    lines += ["Open next: reports/eval.html (scores, per family, paired comparisons), reports/trajectories.html "
              "(episodes), reports/rl/" + final_rl + "/trajectories.html (training episodes); `agentkiln ui` for "
              "MLflow (runs, curves, the registry) and Prefect."]
    return lines
