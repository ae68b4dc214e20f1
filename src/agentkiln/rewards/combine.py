"""A stage's turn rewards: its weighted components, summed per turn.

    reward_k = w_outcome * outcome_k + c * sum_(other components) w * clip(value_k, -1, 1)

c = min(1, bound / |S|), S the episode's shaping total (the sum over its turns of the second term
without c): shaping is bounded per episode, so a policy that circles states to farm it cannot earn
more than `bound`, less than the outcome of solving the task. Components of weight 0 are not computed.
"""

from __future__ import annotations

from agentkiln.config import RewardParams
from agentkiln.rewards.components import COMPONENTS, Context
from agentkiln.rewards.state import RewardState
from agentkiln.rollout.episode import Episode


def _clip(v: float) -> float:
    return max(-1.0, min(1.0, v))


def turn_rewards(episodes: list[Episode], params: RewardParams, state: RewardState
                 ) -> tuple[list[list[float]], dict[str, float]]:
    """(per episode, the total reward of each turn; per active component, the mean over episodes of
    its weighted sum, before the bound, plus `shaped_return`: the mean episode total)."""
    ctx = Context(params, state)
    active = {name: cfg for name, cfg in params.components().items() if cfg.weight != 0}
    sums = dict.fromkeys(active, 0.0)
    out = []
    for ep in episodes:
        n = len(ep.turns)
        base, shaping = [0.0] * n, [0.0] * n
        for name, cfg in active.items():
            values = COMPONENTS[name](ep, ctx, cfg)
            if len(values) != n:
                raise ValueError(f"reward component {name}: {len(values)} values for {n} turns")
            if name != "outcome":
                values = [cfg.weight * _clip(v) for v in values]
                shaping = [s + v for s, v in zip(shaping, values)]
            else:
                values = [cfg.weight * v for v in values]
                base = values
            sums[name] += sum(values)
        total = sum(shaping)
        if abs(total) > params.bound:
            c = params.bound / abs(total)
            shaping = [c * s for s in shaping]
        out.append([b + s for b, s in zip(base, shaping)])
    k = max(1, len(episodes))
    means = {name: v / k for name, v in sums.items()}
    means["shaped_return"] = sum(sum(rs) for rs in out) / k
    return out, means
