"""Baselines every panel is played with: the random admissible action (the floor) and the expert
oracle (the ceiling: each environment's own solver, reading the true state, not the text)."""

from __future__ import annotations

from agentkiln.rollout.agents import AgentState, RandomAgent
from agentkiln.rollout.constrained import Generation

__all__ = ["OracleAgent", "RandomAgent", "BASELINES"]


class OracleAgent:
    """Plays `env.expert_action()` (shortest path, A* for Sokoban, the gold query for tools).
    The rollout engine hands it the environments because `needs_env` is set. When the expert has
    nothing to say (it gave up), it plays the first admissible action, which is counted as played."""

    needs_env = True

    def act(self, states: list[AgentState], envs) -> list[Generation]:
        out = []
        for s, env in zip(states, envs):
            action = env.expert_action()
            if action is None:
                action = s.admissible[0] if s.admissible else ""
            out.append(Generation(ids=[], allowed=[], logprobs=[], action=action))
        return out


BASELINES = {"random": RandomAgent, "oracle": OracleAgent}
