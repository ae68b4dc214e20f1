"""Agents map environment states to actions: the LM policy (constrained decoding) and the random
admissible-action baseline. Both return `Generation`s so the rollout engine treats them alike."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from agentkiln.policy.model import Policy
from agentkiln.policy.prompt import build_prompt
from agentkiln.rollout.constrained import ActionTrie, Generation, generate_actions


@dataclass
class AgentState:
    goal: str
    past_actions: list[str]
    observation: str
    admissible: list[str]


class PolicyAgent:
    def __init__(
        self,
        policy: Policy,
        temperature: float = 1.0,
        greedy: bool = False,
        seed: int = 0,
        batch_size: int = 64,
        decoding: str = "constrained",
    ):
        if decoding not in ("constrained", "free"):
            raise ValueError(f"decoding {decoding!r}: expected constrained or free")
        self.policy, self.temperature, self.greedy, self.batch_size = policy, temperature, greedy, batch_size
        self.decoding = decoding
        self.generator = torch.Generator().manual_seed(seed)
        self._action_ids: dict[str, list[int]] = {}

    def _trie(self, admissible: list[str]) -> ActionTrie:
        for a in admissible:
            if a not in self._action_ids:
                self._action_ids[a] = self.policy.encode_action(a)
        return ActionTrie({a: self._action_ids[a] for a in admissible})

    def act(self, states: list[AgentState]) -> list[Generation]:
        """One action per state: constrained to its admissible actions (a prefix trie over their ids),
        or, with decoding="free", generated over the whole vocabulary (the prompt still lists the
        admissible actions; an action outside them is the environment's invalid step)."""
        if self.decoding == "constrained" and any(not s.admissible for s in states):
            raise ValueError(
                "constrained decoding needs a non-empty admissible action list per state: free-form families "
                "(search-qa, sql, python-tool) cannot be played by this agent; leave them out of the splits"
            )
        prompts = [
            self.policy.encode_prompt(build_prompt(self.policy.fmt, s.goal, s.past_actions, s.observation, s.admissible))
            for s in states
        ]
        tries = [self._trie(s.admissible) if self.decoding == "constrained" else None for s in states]
        out: list[Generation] = []
        for i in range(0, len(states), self.batch_size):
            out += generate_actions(
                self.policy,
                prompts[i : i + self.batch_size],
                tries[i : i + self.batch_size],
                temperature=self.temperature,
                greedy=self.greedy,
                generator=self.generator,
            )
        return out


class RandomAgent:
    """Uniform over the admissible actions: the floor every trained policy must clear."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, states: list[AgentState]) -> list[Generation]:
        return [Generation(ids=[], allowed=[], logprobs=[], action=self.rng.choice(s.admissible)) for s in states]
