"""Play a panel and summarise it: success with a Wilson CI, breakdowns (family, difficulty level,
task type), efficiency (turns, generated tokens, invalid actions, tool calls per episode) and
pass@k from n sampled episodes per task.

One record per (task, sample): the unit every statistic here and every paired comparison is built
from. Records are ordered as the panel's manifest, so two policies' records pair up by position.
"""

from __future__ import annotations

import re
from pathlib import Path

from agentkiln.envs import TaskSpec
from agentkiln.stats import pass_at_k, wilson_interval
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode

TOOL_CALL = re.compile(r"\s*([A-Za-z_]+)\s*\[")


def tool_calls(episode: Episode) -> int:
    """Calls of a tool (`name[...]` other than `answer[...]`) in free-form families (no admissible list)."""
    n = 0
    for t in episode.turns:
        m = TOOL_CALL.match(t.action) if not t.admissible else None
        n += bool(m and m.group(1).lower() != "answer")
    return n


def records(episodes: list[Episode], tasks: list[TaskSpec], samples: int, levels: dict[str, str] | None = None,
            panel: str = "") -> list[dict]:
    """Flatten episodes (played with group_size=samples, tasks in manifest order) into records."""
    if len(episodes) != len(tasks) * samples:
        raise ValueError(f"expected {len(tasks)} tasks x {samples} samples episodes, got {len(episodes)}")
    out = []
    for i, e in enumerate(episodes):
        task = tasks[i // samples]
        if e.task_id != task.task_id:
            raise ValueError(f"episode {i} is of task {e.task_id}, expected {task.task_id}")
        out.append({
            "task_id": task.task_id, "family": task.family, "task_type": task.task_type,
            "level": (levels or {}).get(task.task_type, "unknown"), "panel": panel, "sample": i % samples,
            "won": bool(e.won), "turns": len(e.turns), "tokens": e.n_tokens,
            "invalid": e.n_invalid, "tool_calls": tool_calls(e),
        })
    return out


def play(agent, tasks: list[TaskSpec], tasks_dir: str | Path, max_turns: int | None, samples: int = 1,
         levels: dict[str, str] | None = None, panel: str = "", progress: str | None = None) -> list[dict]:
    episodes = run_episodes(agent, tasks, tasks_dir, max_turns, group_size=samples, progress=progress)
    return records(episodes, tasks, samples, levels, panel)


def summarize(recs: list[dict], confidence: float = 0.95) -> dict:
    """Success (Wilson CI) and efficiency over records."""
    n = len(recs)
    k = sum(r["won"] for r in recs)
    lo, hi = wilson_interval(k, n, confidence)
    turns = sum(r["turns"] for r in recs)
    return {
        "success": k / n if n else 0.0, "ci_low": lo, "ci_high": hi, "n_tasks": n,
        "mean_turns": turns / n if n else 0.0,
        "invalid_rate": sum(r["invalid"] for r in recs) / turns if turns else 0.0,
        "tokens_per_episode": sum(r["tokens"] for r in recs) / n if n else 0.0,
        "tool_calls_per_episode": sum(r["tool_calls"] for r in recs) / n if n else 0.0,
    }


def breakdown(recs: list[dict], key: str, confidence: float = 0.95) -> dict:
    return {v: summarize([r for r in recs if r[key] == v], confidence) for v in sorted({r[key] for r in recs})}


def panel_summary(recs: list[dict], confidence: float = 0.95) -> dict:
    """Overall metrics plus by_family, by_level and by_task_type (same statistics each)."""
    return summarize(recs, confidence) | {
        "by_family": breakdown(recs, "family", confidence),
        "by_level": breakdown(recs, "level", confidence),
        "by_task_type": breakdown(recs, "task_type", confidence),
    }


def pass_at_k_curve(recs: list[dict], ks: list[int]) -> dict[int, float]:
    """Mean over tasks of the unbiased pass@k, from each task's n samples and c successes."""
    by_task: dict[str, list[bool]] = {}
    for r in recs:
        by_task.setdefault(r["task_id"], []).append(r["won"])
    if not by_task:
        raise ValueError("pass@k needs at least one record")
    n = min(len(v) for v in by_task.values())
    if any(len(v) != n for v in by_task.values()):
        raise ValueError("pass@k needs the same number of samples for every task")
    return {k: sum(pass_at_k(n, sum(v), k) for v in by_task.values()) / len(by_task) for k in ks if k <= n}


def success_rates(recs: list[dict]) -> dict[str, float]:
    """Per-task success rate over its samples (manifest order): sampled play's paired-comparison vector."""
    won: dict[str, list[int]] = {}
    for r in recs:
        won.setdefault(r["task_id"], []).append(int(r["won"]))
    return {t: sum(v) / len(v) for t, v in won.items()}


def outcomes(recs: list[dict]) -> list[int]:
    """Per-task success of sample 0, in manifest order: the vector paired comparisons use."""
    return [int(r["won"]) for r in recs if r["sample"] == 0]
