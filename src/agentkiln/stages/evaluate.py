"""Evaluate every policy on the frozen panels: the test panel (task types seen in training) and,
when synthesized, the out-of-distribution panel (held-out types), greedy; pass@k from sampled
episodes on the test panel; paired comparisons between policies; baselines random and oracle.

Every input is read and checked first (`check_inputs`: the panels, each policy's saved directory, each
RL curve), before Ray starts or any episode is played: a bad one is refused at once, in one line.

Outputs (reports/): metrics.json (per policy: test metrics + breakdowns + efficiency + pass@k, and
`ood`), outcomes.json (per-task success per policy and panel: what paired comparisons and the
promotion gate use), comparisons.json, and the human reports (evaluation/report.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentkiln import fanout
from agentkiln.artifacts import MissingArtifactError, rebuild_hint
from agentkiln.config import PANELS, Params
from agentkiln.evaluate import trajectories
from agentkiln.evaluate.agents import greedy_agent, pass_k_ks, policy_agent, task_levels
from agentkiln.evaluate.harness import pass_at_k_curve, panel_summary, play, records, success_rates
from agentkiln.panels import load_panel, panel_id, split_exists
from agentkiln.evaluate.report import read_curve, write_reports
from agentkiln.stats import compare_paired
from agentkiln.paths import repo_root
from agentkiln.policy import load_policy
from agentkiln.policy.model import saved_meta
from agentkiln.registry import lineage
from agentkiln.rollout.engine import run_episodes

BASELINES = ("random", "oracle")  # played without a model


def paired_comparisons(p, per_task: dict[str, dict[str, dict[str, int]]], sampled: dict[str, dict[str, float]],
                       panels: dict[str, list]) -> list[dict]:
    """Every `compare` pair (a, b), paired over the same tasks: on each panel, greedy, over the whole
    panel (`family` None) and within each family (a headline never hides a family that regressed);
    then on the test panel's sampled play where both have pass@k samples (each task's success rate
    over its samples: what RL optimises, without greedy decoding's ties and loops)."""
    out = []
    for panel, tasks in panels.items():
        groups = [(None, [t.task_id for t in tasks])]
        families = sorted({t.family for t in tasks})
        if len(families) > 1:
            groups += [(f, [t.task_id for t in tasks if t.family == f]) for f in families]
        for a, b in p.compare:
            ta, tb = per_task[a][panel], per_task[b][panel]
            for family, ids in groups:
                c = compare_paired([ta[t] for t in ids], [tb[t] for t in ids], p.confidence, p.n_boot, p.seed)
                out.append({"a": a, "b": b, "decoding": "greedy", "panel": panel, "family": family,
                            "n_tasks": len(ids), **c})
    for a, b in p.compare:
        if a in sampled and b in sampled:
            sa, sb = sampled[a], sampled[b]
            c = compare_paired([sa[t] for t in sa], [sb[t] for t in sa], p.confidence, p.n_boot, p.seed)
            out.append({"a": a, "b": b, "decoding": f"sampled T={p.pass_k.temperature:g} x{p.pass_k.samples}",
                        "panel": "test", "family": None, "n_tasks": len(sa), **c})
    return out


def check_inputs(params: Params, tasks_dir: Path, model_dirs: dict[str, Path],
                 curves: dict[str, Path] | None = None) -> dict[str, list]:
    """Read and check everything the evaluation will use, before any of its work: the panels (sealed
    manifests), each evaluated policy's directory (its manifest: every file present with its sha256,
    and agent.json) and each RL stage's curve.csv (columns and values). Raises ArtifactError /
    MissingArtifactError (ValueError / FileNotFoundError) naming the file and the stage to re-run.
    Returns the panels: name -> tasks."""
    panels = {name: load_panel(tasks_dir, name) for name in PANELS
              if name in params.evaluate.panels and (name == "test" or split_exists(tasks_dir, name))}
    for name in params.evaluate.policies:
        if name in BASELINES:
            continue
        if name not in model_dirs:
            raise ValueError(f"params.yaml evaluate.policies lists {name!r}, but no model directory was given for "
                             f"it (given: {', '.join(sorted(model_dirs)) or 'none'}); remove it from evaluate.policies")
        d = Path(model_dirs[name])
        if not d.is_dir():
            raise MissingArtifactError(f"{d}: model directory of policy {name!r} missing; {rebuild_hint(d)}")
        saved_meta(d)  # a saved policy's manifest and agent.json: a damaged file is named before any play
    for stage, curve in (curves or {}).items():
        if Path(curve).is_file():  # an RL stage that has not run has no curve: nothing to plot, not an error
            read_curve(curve, stage)
    return panels


def run_evaluate(params: Params, tasks_dir: Path, model_dirs: dict[str, Path], reports_dir: Path,
                 curves: dict[str, Path] | None = None) -> dict:
    panels = check_inputs(params, tasks_dir, model_dirs, curves)  # before Ray starts or any episode is played
    return _evaluate(params, tasks_dir, model_dirs, reports_dir, curves, panels)


@fanout.in_session
def _evaluate(params: Params, tasks_dir: Path, model_dirs: dict[str, Path], reports_dir: Path,
              curves: dict[str, Path] | None, panels: dict[str, list]) -> dict:
    p = params.evaluate
    levels = task_levels(params)
    metrics: dict[str, dict] = {}
    per_task: dict[str, dict] = {}
    sampled: dict[str, dict[str, float]] = {}  # policy -> task -> success rate over its pass@k samples
    shown: dict[str, list] = {}  # policy -> the test episodes the trajectory viewer shows
    for name in p.policies:
        policy = None if name in BASELINES else load_policy(model_dirs[name], compute=params.compute)
        for panel, tasks in panels.items():
            # a fresh agent per panel: the random baseline's draws do not depend on which panels exist
            episodes = run_episodes(greedy_agent(name, policy, params), tasks, tasks_dir, p.max_turns,
                                    progress=f"eval {name} {panel}")
            recs = records(episodes, tasks, 1, levels, panel)
            if panel == "test":
                shown[name] = trajectories.sample(episodes)
            m = panel_summary(recs, p.confidence)
            per_task.setdefault(name, {})[panel] = {r["task_id"]: int(r["won"]) for r in recs}
            if panel == "test":
                metrics[name] = m | {"n_params": policy.n_params() if policy else None}
            else:
                metrics[name][panel] = m
        if name in p.pass_k.policies:
            agent = policy_agent(policy, p, temperature=p.pass_k.temperature, seed=p.seed)
            recs = play(agent, panels["test"], tasks_dir, p.max_turns, samples=p.pass_k.samples, levels=levels,
                        panel="test", progress=f"pass@k {name}")
            metrics[name]["pass_at_k"] = {str(k): v for k, v in pass_at_k_curve(recs, pass_k_ks(p.pass_k.samples)).items()}
            metrics[name]["pass_at_k_samples"] = p.pass_k.samples
            sampled[name] = success_rates(recs)
    comparisons = paired_comparisons(p, per_task, sampled, panels)
    panel_ids = {panel: panel_id(tasks_dir, panel) for panel in panels}
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    (reports_dir / "outcomes.json").write_text(json.dumps({"panels": panel_ids, "outcomes": per_task},
                                                          indent=1, sort_keys=True) + "\n")
    root = repo_root()
    meta = {"commit": lineage.git_commit(root), "commit date": lineage.commit_date(root),
            "params.yaml": lineage.params_hash(root / "params.yaml"), "seed": params.evaluate.seed}
    trajectories.write(shown, reports_dir / "trajectories.html")
    write_reports(metrics, reports_dir, comparisons=comparisons, curves=curves, panels=panel_ids, meta=meta)
    return metrics
