"""The agents a panel is played with, shared by the evaluate stage and `python -m agentkiln.evaluate`:
the baselines, and a policy with the evaluate section's decoding settings."""

from __future__ import annotations

from agentkiln.config import Params
from agentkiln.evaluate.baselines import OracleAgent, RandomAgent
from agentkiln.rollout.agents import PolicyAgent


def task_levels(params: Params) -> dict[str, str]:
    """task type -> difficulty level (easy / medium / hard), for the per-difficulty breakdown."""
    return {name: t.level for name, t in params.synthesize.task_types.items()}


def greedy_agent(name: str, policy, params: Params):
    p = params.evaluate
    if name == "random":
        return RandomAgent(seed=p.seed)
    if name == "oracle":
        return OracleAgent()
    return policy_agent(policy, p, greedy=True)


def policy_agent(policy, p, greedy: bool = False, temperature: float = 1.0, seed: int = 0) -> PolicyAgent:
    """The agent that plays a policy on a panel, with the evaluate section's decoding settings."""
    return PolicyAgent(policy, temperature=temperature, greedy=greedy, seed=seed, batch_size=p.batch_size,
                       decoding=p.decoding, max_reply_tokens=p.max_reply_tokens)


def pass_k_ks(samples: int) -> list[int]:
    ks, k = [], 1
    while k <= samples:
        ks.append(k)
        k *= 2
    return ks + ([samples] if ks[-1] != samples else [])
