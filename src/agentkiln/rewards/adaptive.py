"""Shaping that fades where the learner already succeeds: per task type, the base component (potential
by default) is scaled by 1 - success_type, success_type an exponential moving average over iterations
of the type's success rate. A type the policy has mastered stops being shaped (its outcome reward
alone drives it); a type it fails keeps the teacher's full guidance.
"""

from __future__ import annotations

from agentkiln.rewards.components import COMPONENTS, Context, component
from agentkiln.rollout.episode import Episode


def task_type(ep: Episode) -> str:
    return ep.task_type or ep.family


class SuccessEMA:
    """Each task type's success, an exponential moving average over iterations (0 before any)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.success: dict[str, float] = {}

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        """Fold in one iteration's episodes; returns the new estimates of the types seen."""
        by_type: dict[str, list[bool]] = {}
        for ep in episodes:
            by_type.setdefault(task_type(ep), []).append(ep.won)
        for name, won in by_type.items():
            rate = sum(won) / len(won)
            self.success[name] = self.decay * self.success.get(name, 0.0) + (1 - self.decay) * rate
        return {name: self.success[name] for name in by_type}

    def scale(self, ep: Episode) -> float:
        """The adaptive weight factor 1 - success of the episode's type."""
        return 1.0 - self.success.get(task_type(ep), 0.0)

    def state_dict(self) -> dict:
        return {"success": dict(self.success)}

    def load_state_dict(self, state: dict) -> None:
        self.success = dict(state["success"])


@component("adaptive")
def adaptive(ep: Episode, ctx: Context, cfg) -> list[float]:
    """The base component's values times 1 - the EMA success of the episode's task type."""
    base_cfg = getattr(ctx.params, cfg.base)
    factor = ctx.state.success.scale(ep)
    return [factor * v for v in COMPONENTS[cfg.base](ep, ctx, base_cfg)]
