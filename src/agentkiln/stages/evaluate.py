"""Evaluate every policy on the frozen panels: the test split (same task types as training) and,
when synthesized, the out-of-distribution split (held-out harder types). Success with a Wilson CI,
turns and invalid rate, overall and per family."""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import Params
from agentkiln.evaluation.report import write_reports
from agentkiln.evaluation.stats import summarize_episodes
from agentkiln.policy import load_policy
from agentkiln.rollout.agents import PolicyAgent, RandomAgent
from agentkiln.rollout.engine import Episode, run_episodes
from agentkiln.stages.common import load_split, split_exists

PANELS = ("test", "ood")


def panel_metrics(episodes: list[Episode], families: list[str], confidence: float) -> dict:
    """Overall metrics of a panel plus `by_family` (one entry per family, same statistics)."""

    def summary(eps):
        return summarize_episodes([e.won for e in eps], [len(e.turns) for e in eps], [e.n_invalid for e in eps],
                                  confidence)

    m = summary(episodes)
    m["by_family"] = {f: summary([e for e, g in zip(episodes, families) if g == f]) for f in sorted(set(families))}
    return m


def run_evaluate(params: Params, tasks_dir: Path, model_dirs: dict[str, Path], reports_dir: Path) -> dict:
    p = params.evaluate
    panels = {name: load_split(tasks_dir, name) for name in PANELS if name == "test" or split_exists(tasks_dir, name)}
    metrics: dict[str, dict] = {}
    for name in p.policies:
        if name == "random":
            n_params = None
        else:
            policy = load_policy(model_dirs[name])
            n_params = policy.n_params()
        for panel, tasks in panels.items():
            # a fresh agent per panel: the random baseline's draws do not depend on which panels exist
            agent = RandomAgent(seed=p.seed) if name == "random" else PolicyAgent(policy, greedy=True, decoding=p.decoding)
            episodes = run_episodes(agent, tasks, tasks_dir, p.max_turns, progress=f"eval {name} {panel}")
            m = panel_metrics(episodes, [t.family for t in tasks], p.confidence)
            if panel == "test":
                metrics[name] = m | {"n_params": n_params}
            else:
                metrics[name][panel] = m
    write_reports(metrics, reports_dir)
    return metrics
