"""A toy reward component from outside agentkiln: a bonus for winning within a number of turns.

A plugin module (params.yaml: `plugins: [docs/examples/first_try_bonus.py]`) that registers the component
`quick_win` with its own settings, validated where params name it, with no field in agentkiln's config:

    rl:
      defaults:
        reward:
          quick_win: {weight: 0.5, within: 3}

Like every shaping component its per-turn values are clipped to [-1, 1], times its weight, and bounded
per episode with the others (`reward.bound`). docs/extending.md walks through it.
"""

from __future__ import annotations

from pydantic import Field

from agentkiln.config import RewardComponent
from agentkiln.rewards import register_reward


class QuickWin(RewardComponent):
    within: int = Field(3, ge=1, le=1000, description="a win in at most this many turns earns the bonus")


def quick_win(episode, ctx, cfg: QuickWin) -> list[float]:
    """1 on the winning turn of an episode won within `cfg.within` turns, 0 on every other turn."""
    values = [0.0] * len(episode.turns)
    if episode.won and len(episode.turns) <= cfg.within:
        values[-1] = 1.0
    return values


register_reward("quick_win", quick_win, QuickWin)
