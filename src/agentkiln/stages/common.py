"""Helpers every stage uses: seeding, reading split manifests, turning expert rows into states."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from agentkiln.rollout.agents import AgentState
from agentkiln.evaluate.panels import load_panel as load_split  # noqa: F401  (re-exported)
from agentkiln.evaluate.panels import split_exists  # noqa: F401


def seed_everything(seed: int, threads: int) -> None:
    """Same params + seed => same metrics on the same machine (CPU kernels are deterministic at a
    fixed thread count)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def expert_pairs(df) -> list[tuple[AgentState, str]]:
    """Rebuild what the agent saw at each expert step (past actions come from earlier rows)."""
    pairs = []
    for _, rows in df.sort_values(["task_id", "step"]).groupby("task_id", sort=True):
        past: list[str] = []
        for r in rows.itertuples():
            pairs.append((AgentState(r.goal, list(past), r.observation, json.loads(r.admissible)), r.action))
            past.append(r.action)
    return pairs
