"""Baselines every panel is played with: the random admissible action (the floor) and the expert
oracle (the ceiling: each environment's own solver, reading the true state, not the text)."""

from __future__ import annotations

from agentkiln.envs import Env
from agentkiln.rollout.agents import RandomAgent
from agentkiln.rollout.episode import Episode

__all__ = ["OracleAgent", "RandomAgent", "BASELINES"]


class OracleAgent:
    """Plays `env.expert_action()` (shortest path, A* for Sokoban, the gold query for tools). When the
    expert has nothing to say (it gave up), it plays the first admissible action, which is counted as played."""

    batch_size = None

    def act(self, episodes: list[Episode], envs: list[Env]) -> list[str]:
        out = []
        for ep, env in zip(episodes, envs):
            action = env.expert_action()
            if action is None:
                adm = ep.turns[-1].admissible
                action = adm[0] if adm else ""
            out.append(action)
        return out


BASELINES = {"random": RandomAgent, "oracle": OracleAgent}
