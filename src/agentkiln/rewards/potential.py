"""Teacher-driven potential-based shaping (Ng, Harada & Russell 1999).

    F_k = gamma * Phi(s_(k+1)) - Phi(s_k),     Phi(s) = -(the expert's steps to a win from s) / scale

s_k is the state turn k acted in, s_T the state after the last turn (Phi = 0 at a won goal). The
discounted sum telescopes: sum_k gamma^k F_k = gamma^T Phi(s_T) - Phi(s_0), whatever path was taken,
so the optimal policy is unchanged while every step towards the goal pays at once. Distances come
from the rollout (run_episodes(potentials=True): Turn.to_go, Episode.end_to_go); a state the expert
cannot win from counts `unreachable` steps.
"""

from __future__ import annotations

from agentkiln.rewards.components import Context, component
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.potentials import UNREACHABLE


def phi(to_go: int | None, cfg) -> float:
    """The potential of a state `to_go` expert steps from a win."""
    if to_go is None:
        raise ValueError("potential shaping needs the expert's distances: play with run_episodes(potentials=True)")
    return -(cfg.unreachable if to_go == UNREACHABLE else to_go) / cfg.scale


def potentials(ep: Episode, cfg) -> list[float]:
    """Phi(s_0), ..., Phi(s_T): one per turn, then the state after the last turn."""
    return [phi(t.to_go, cfg) for t in ep.turns] + [phi(ep.end_to_go, cfg)]


@component("potential")
def potential(ep: Episode, ctx: Context, cfg) -> list[float]:
    """gamma * Phi(next state) - Phi(state) for every turn."""
    p, g = potentials(ep, cfg), ctx.state.gamma
    return [g * p[k + 1] - p[k] for k in range(len(ep.turns))]
