"""Helpers every stage uses: reading split manifests, expert demonstrations as episodes."""

from __future__ import annotations

import json

from agentkiln.panels import load_panel as load_split  # noqa: F401  (re-exported)
from agentkiln.panels import split_exists  # noqa: F401
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.schemas import VARIANTS


def used_variants(data) -> list[str]:
    """The expert table's variants SFT trains on (`sft.data`: those of nonzero weight)."""
    return [v for v in VARIANTS if getattr(data, v) > 0]


def expert_episodes(df) -> list[Episode]:
    """The expert table's episodes as text (observation, admissible actions, action per turn), in
    episode-key order (a task's clean walkthrough `<task_id>/clean` first among its episodes when only
    clean rows are given); `rollout.sequence.render` turns them into the token sequences a policy trains
    on. A recovery episode's injected mistakes keep `Turn.mistake` (SFT: context, no loss)."""
    out = []
    for g, (_, rows) in enumerate(df.sort_values(["episode", "step"]).groupby("episode", sort=True)):
        first = rows.iloc[0]
        ep = Episode(first.task_id, first.family, g, first.task_type, goal=first.goal, won=bool(rows["done"].iloc[-1]))
        for r in rows.itertuples():
            ep.turns.append(Turn(r.observation, json.loads(r.admissible), "", reply=r.action, action=r.action,
                                 reward=r.reward, mistake=bool(r.mistake)))
        out.append(ep)
    return out
