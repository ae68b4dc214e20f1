"""Teacher-driven potential-based shaping (Ng, Harada & Russell 1999).

    F_k = gamma * Phi(s_(k+1)) - Phi(s_k),     Phi(s) = -(the expert's steps to a win from s) / scale

s_k is the state turn k acted in, s_T the state after the last turn. The discounted sum telescopes:
sum_k gamma^k F_k = gamma^T Phi(s_T) - Phi(s_0), whatever path was taken. Policy invariance needs
Phi = 0 at every terminal state, won or lost (Ng et al. 1999 for the absorbing state; Grzes 2017 for
episodic tasks with several): then every episode the task ends pays the same shaping, -Phi(s_0), and
only the outcome tells them apart. (Phi = -`unreachable` at a lost terminal state, as this component
had it first, is a penalty for ending a game lost that waiting out the turn limit does not pay: on the
word problems it taught the policy not to answer, docs/journal.md, 2026-11-28 "Potential shaping, corrected".) A state
the expert cannot win from while the game goes on counts `unreachable` steps; an episode cut by the turn
limit ends at its last state's Phi. Distances come from the rollout (run_episodes(potentials=True):
Turn.to_go, Episode.end_to_go).
"""

from __future__ import annotations

from agentkiln.rewards.components import Context, component
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.potentials import ENDED, UNREACHABLE


def phi(to_go: int | None, cfg) -> float:
    """The potential of a state `to_go` expert steps from a win (0 at a terminal state)."""
    if to_go is None:
        raise ValueError("potential shaping needs the expert's distances: play with run_episodes(potentials=True)")
    if to_go == ENDED:
        return 0.0
    return -(cfg.unreachable if to_go == UNREACHABLE else to_go) / cfg.scale


def potentials(ep: Episode, cfg) -> list[float]:
    """Phi(s_0), ..., Phi(s_T): one per turn, then the state after the last turn."""
    return [phi(t.to_go, cfg) for t in ep.turns] + [phi(ep.end_to_go, cfg)]


@component("potential")
def potential(ep: Episode, ctx: Context, cfg) -> list[float]:
    """gamma * Phi(next state) - Phi(state) for every turn."""
    p, g = potentials(ep, cfg), ctx.state.gamma
    return [g * p[k + 1] - p[k] for k in range(len(ep.turns))]
