"""Evaluate every policy on the frozen test panel: success with a Wilson CI, turns, invalid rate."""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import Params
from agentkiln.evaluation.report import write_reports
from agentkiln.evaluation.stats import summarize_episodes
from agentkiln.policy import load_policy
from agentkiln.rollout.agents import PolicyAgent, RandomAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.stages.common import load_split


def run_evaluate(params: Params, tasks_dir: Path, model_dirs: dict[str, Path], reports_dir: Path) -> dict:
    p = params.evaluate
    panel = load_split(tasks_dir, "test")
    metrics: dict[str, dict] = {}
    for name in p.policies:
        if name == "random":
            agent, n_params = RandomAgent(seed=p.seed), None
        else:
            policy = load_policy(model_dirs[name])
            agent, n_params = PolicyAgent(policy, greedy=True), policy.n_params()
        episodes = run_episodes(agent, panel, tasks_dir, p.max_turns, progress=f"eval {name}")
        m = summarize_episodes(
            [e.won for e in episodes], [len(e.turns) for e in episodes], [e.n_invalid for e in episodes], p.confidence
        )
        m["n_params"] = n_params
        metrics[name] = m
    write_reports(metrics, reports_dir)
    return metrics
