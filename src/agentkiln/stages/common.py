"""Helpers every stage uses: seeding, reading split manifests, turning expert rows into states."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from agentkiln.envs import TaskSpec
from agentkiln.rollout.agents import AgentState
from agentkiln.synthesis.generate import env_version


def seed_everything(seed: int, threads: int) -> None:
    """Same params + seed => same metrics on the same machine (CPU kernels are deterministic at a
    fixed thread count)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def split_exists(tasks_dir: Path, split: str) -> bool:
    return (Path(tasks_dir) / split / "manifest.json").is_file()


def load_split(tasks_dir: Path, split: str) -> list[TaskSpec]:
    """The tasks of a split. A panel is only valid for the environment code that made it: a
    manifest whose environment versions differ from the code's is refused."""
    path = Path(tasks_dir) / split / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run the synthesize stage first (dvc repro synthesize)")
    try:
        manifest = json.loads(path.read_text())
        tasks = [TaskSpec(**t) for t in manifest["tasks"]]
        versions = manifest["env_versions"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a valid task manifest ({e})") from e
    for family in sorted({t.family for t in tasks}):
        if versions.get(family) != (current := env_version(family)):
            raise ValueError(
                f"{path}: {family} tasks were made by environment version {versions.get(family)}, the code is "
                f"{current}: re-run the synthesize stage (dvc repro synthesize)"
            )
    return tasks


def expert_pairs(df) -> list[tuple[AgentState, str]]:
    """Rebuild what the agent saw at each expert step (past actions come from earlier rows)."""
    pairs = []
    for _, rows in df.sort_values(["task_id", "step"]).groupby("task_id", sort=True):
        past: list[str] = []
        for r in rows.itertuples():
            pairs.append((AgentState(r.goal, list(past), r.observation, json.loads(r.admissible)), r.action))
            past.append(r.action)
    return pairs
