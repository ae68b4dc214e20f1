"""Promotion: register the best candidate as `challenger` with its lineage and per-task scores;
make it `champion` only if the gate (`agentkiln.registry.promotion.gate`) says it beats the current
champion on the same frozen panel: by the margin, with the paired CI above zero, no guard regressed.
This module performs the registry side effects; the rule itself is pure and tested apart.

Every score it registers, logs and gates on (candidate, champion, random floor, ood guard) is computed
from the per-task outcomes (reports/outcomes.json), never taken from metrics.json's aggregates: those
must agree with the outcomes or nothing is registered. The invalid_rate and mean_turns guards, which
per-task outcomes do not hold, are the only figures read from metrics.json.

Promotions of concurrent runs on one store are serialised: the champion is read, compared and
replaced under the registry lock (agentkiln.registry.lock), so each run compares against the
champion it actually replaces and every promoted version stays on the `promoted_over` chain.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlflow

from agentkiln import paths
from agentkiln.artifacts import ArtifactError, MetricsFile, OutcomesFile, read_json
from agentkiln.config import OPTIONAL_PANELS, PANELS, EvaluateParams, Params, PromoteParams
from agentkiln.panels import load_manifest, panel_id
from agentkiln.evaluate.report import DECIMALS
from agentkiln.stats import wilson_interval
from agentkiln.registry.lineage import lineage_tags
from agentkiln.registry.lock import registry_lock
from agentkiln.registry.model_registry import champion, promote, register_candidate
from agentkiln.registry.promotion import Guard, gate, pick_candidate
from agentkiln.collected import split_digest

LOWER_IS_BETTER = {"invalid_rate", "mean_turns"}
TOLERANCE = 0.5 * 10 ** -DECIMALS + 1e-12  # metrics.json's numbers are rounded to DECIMALS places


stage_of = paths.stage_writing  # the DVC stage that produced a candidate


def guard_value(metrics: dict, metric: str) -> float | None:
    if metric == "ood_success":
        return metrics.get("ood", {}).get("success")
    return metrics.get(metric)


def encode_outcomes(per_task: dict[str, int]) -> str:
    """Per-task outcomes as a string of 0/1 in task-id order: fits a registry tag (<= 5000 chars)."""
    return "".join(str(int(per_task[t])) for t in sorted(per_task))


def read_reports(reports_dir: Path) -> tuple[dict, dict]:
    """metrics.json and outcomes.json of the evaluate stage, checked against their schemas: a missing,
    unparsable or off-schema file is refused naming it (agentkiln.artifacts.read_json)."""
    reports_dir = Path(reports_dir)
    hint = "run the evaluate stage first (dvc repro evaluate)"
    metrics = read_json(reports_dir / "metrics.json", MetricsFile, "evaluation metrics", hint, as_model=False)
    outcomes = read_json(reports_dir / "outcomes.json", OutcomesFile, "per-task outcomes", hint, as_model=False)
    return metrics, outcomes


def outcome_scores(per_panel: dict[str, dict[str, int]], confidence: float) -> dict:
    """A policy's scores computed from its per-task outcomes (outcomes.json), shaped like its entry of
    metrics.json: test-panel success, Wilson CI and task count; `val` and `ood` the same where it has them."""
    def score(won: dict[str, int]) -> dict:
        k, n = sum(won.values()), len(won)
        lo, hi = wilson_interval(k, n, confidence)
        return {"success": k / n if n else 0.0, "ci_low": lo, "ci_high": hi, "n_tasks": n}

    return score(per_panel["test"]) | {p: score(per_panel[p]) for p in OPTIONAL_PANELS if p in per_panel}


REEVALUATE = "re-run `agentkiln stage evaluate` (dvc repro evaluate)"


def check_panel_tasks(outcomes: dict, panel_tasks: list[str], reports_dir: Path) -> None:
    """Every policy's test outcomes are those of the panel's tasks: no task dropped, added or renamed."""
    for name, won in sorted(outcomes.items()):
        if "test" in won and (odd := set(won["test"]) ^ set(panel_tasks)):
            raise ArtifactError(f"{Path(reports_dir) / 'outcomes.json'}: policy {name}'s test outcomes are not those "
                                f"of the panel's {len(panel_tasks)} tasks ({len(odd)} differ, e.g. {min(odd)}); "
                                f"{REEVALUATE}")


def checked_scores(metrics: dict, outcomes: dict, confidence: float, reports_dir: Path) -> dict[str, dict]:
    """Every policy's entry of metrics.json with the scores promotion uses (success, CI, task counts,
    ood success) recomputed from outcomes.json. A figure of metrics.json that disagrees with the
    outcomes (a hand edit, files of two runs) is refused naming the file, policy, field and both values."""
    path, hint = Path(reports_dir) / "metrics.json", REEVALUATE
    out = {}
    for name, m in sorted(metrics.items()):
        panels = outcomes.get(name, {})
        for panel in PANELS:
            if panel not in panels and (panel == "test" or m.get(panel) is not None):
                raise ArtifactError(f"{path}: policy {name} has {panel} scores but no per-task {panel} outcomes in "
                                    f"outcomes.json, so they cannot be checked; {hint}")
        derived = outcome_scores(panels, confidence)
        for field, recorded, value in _pairs(m, derived):
            if recorded is not None and abs(float(recorded) - value) > TOLERANCE:
                shown = value if isinstance(value, int) else f"{value:.4f}"
                raise ArtifactError(f"{path}: policy {name}: {field} = {recorded}, but its per-task outcomes in "
                                    f"outcomes.json give {shown}: the reports disagree; {hint}")
        out[name] = m | derived
    return out


def _pairs(recorded: dict, derived: dict, prefix: str = ""):
    """(field, metrics.json's value or None, the value from outcomes) for every derived field."""
    for k, v in derived.items():
        if isinstance(v, dict):
            yield from _pairs(recorded.get(k) or {}, v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", recorded.get(k), v


def run_promote(params: Params, root: Path, tasks_dir: Path, reports_dir: Path, model_dirs: dict[str, Path]) -> dict:
    """Register the best candidate and challenge the champion, on scores computed from the per-task
    outcomes (metrics.json's aggregates must agree with them): nothing is registered otherwise."""
    p, ev = params.promote, params.evaluate
    metrics, outcomes = read_reports(reports_dir)
    panel = panel_id(tasks_dir, "test")
    if outcomes["panels"].get("test") != panel:
        raise ValueError(f"{Path(reports_dir) / 'outcomes.json'}: scored on panel {outcomes['panels'].get('test')}, "
                         f"data/tasks/test is panel {panel}; re-run the evaluate stage (dvc repro evaluate)")
    check_panel_tasks(outcomes["outcomes"], [t["task_id"] for t in load_manifest(tasks_dir, "test")["tasks"]],
                      reports_dir)
    scores = checked_scores(metrics, outcomes["outcomes"], ev.confidence, reports_dir)
    name = pick_candidate(scores, list(p.candidates), p.metric)
    m = scores[name]
    bits = encode_outcomes(outcomes["outcomes"][name]["test"])
    run = mlflow.active_run()
    extra = {
        "candidate": name,
        "stage": stage_of(name, params),
        "eval.panel": panel,
        f"eval.{p.metric}": f"{m[p.metric]:.4f}",
        "eval.ci_low": f"{m['ci_low']:.4f}",
        "eval.ci_high": f"{m['ci_high']:.4f}",
        "eval.outcomes": bits,
        "mlflow_run": run.info.run_id if run else "none",
    }
    extra |= collected_lineage(params)
    for g in p.guards:
        if (v := guard_value(m, g)) is not None:
            extra[f"eval.{g}"] = f"{v:.4f}"
    floor = beats_random(outcomes["outcomes"], name, p, ev)
    if floor is not None:
        extra["eval.vs_random"] = floor.reason
    version = register_candidate(Path(model_dirs[name]), p.model_name, lineage_tags(root, extra), {p.metric: m[p.metric]})
    result = {"candidate": name, "version": version, "score": m[p.metric], "panel": panel}
    if floor is not None and not floor.promote:  # registered (a record of the attempt) but never champion
        return result | {"promoted": False, "reason": f"{name} does not beat the random baseline: {floor.reason}",
                         "diff": floor.diff, "ci_low": floor.ci_low, "ci_high": floor.ci_high, "failed_guards": []}
    return result | challenge(p, ev, version, extra)


def collected_lineage(params: Params) -> dict[str, str]:
    """Lineage tags naming the collected splits (agentkiln collect) the models were trained on, with the
    digest of each split's manifest: `lineage.collected.sft`, `lineage.collected.rl.<stage>`."""
    splits = {"sft": params.sft.data.collected} | {f"rl.{name}": params.rl.stage(name).offline.split
                                                  for name in params.rl.stages}
    return {f"lineage.collected.{k}": f"{v}@{split_digest(v)}" for k, v in splits.items()
            if v and (Path(v) / "manifest.json").is_file()}


def beats_random(outcomes: dict, name: str, p: PromoteParams, ev: EvaluateParams):
    """The floor (promote.floor = random): the candidate against the random baseline on the same
    test-panel tasks, by the same paired gate as against a champion (difference > 0 and its paired
    bootstrap CI above 0). A paired test, not overlapping intervals: both played the same tasks.
    None when there is no floor."""
    if p.floor == "none":
        return None
    if "random" not in outcomes:
        raise ValueError("outcomes.json has no `random` baseline to check the promotion floor against; re-run the "
                         "evaluate stage (dvc repro evaluate) or set promote.floor: none")
    ids = sorted(outcomes[name]["test"])
    mine = [int(outcomes[name]["test"][t]) for t in ids]
    rand = [int(outcomes["random"]["test"][t]) for t in ids]
    d = gate(mine, rand, 0.0, [], ev.confidence, ev.n_boot, ev.seed)
    return replace(d, reason=d.reason.replace("champion", "random"))


def challenge(p: PromoteParams, ev: EvaluateParams, version: str, tags: dict[str, str]) -> dict:
    """Gate registered `version` (its eval tags: `eval.panel`, `eval.outcomes`, `eval.<guard>`)
    against the current champion and promote it if it wins: read, compare and alias moves in one
    critical section of the registry lock."""
    with registry_lock():
        return _challenge(p, ev, version, tags)


def _challenge(p: PromoteParams, ev: EvaluateParams, version: str, extra: dict[str, str]) -> dict:
    result: dict = {}
    panel = extra["eval.panel"]
    current = champion(p.model_name)
    champ_outcomes, guards = None, []
    if current is not None:
        champ_version, champ_tags = current
        result["champion_version"] = champ_version
        if champ_version == version:  # cannot happen (a new version), but never compare a model with itself
            raise RuntimeError(f"new version {version} is already the champion")
        if champ_tags.get("eval.panel") != panel or "eval.outcomes" not in champ_tags:
            # Scores on another panel are not comparable: refuse and say how to fix it.
            return result | {"promoted": False, "reason": f"champion v{champ_version} was not scored on panel {panel}; "
                             "re-evaluate it on this panel (python -m agentkiln.evaluate --model "
                             f"models:/{p.model_name}@champion) or roll back"}
        champ_outcomes = [int(c) for c in champ_tags["eval.outcomes"]]
        result["champion_score"] = sum(champ_outcomes) / len(champ_outcomes)
        for g, tol in p.guards.items():
            mine, theirs = extra.get(f"eval.{g}"), champ_tags.get(f"eval.{g}")
            if mine is not None and theirs is not None:
                guards.append(Guard(g, float(mine), float(theirs), tol, higher_is_better=g not in LOWER_IS_BETTER))
    challenger = [int(c) for c in extra["eval.outcomes"]]
    d = gate(challenger, champ_outcomes, p.margin, guards, ev.confidence, ev.n_boot, ev.seed)
    if d.promote:
        promote(p.model_name, version)
    return result | {"promoted": d.promote, "reason": d.reason, "diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high,
                     "failed_guards": list(d.failed_guards)}
