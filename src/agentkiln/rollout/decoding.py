"""Choosing reply tokens: free sampling over the vocabulary, or constrained to admissible actions.

Constrained decoding: each admissible action's reply ids (its text as the chat template renders it,
then the end-of-turn token) form a prefix trie; at every step the logits outside the current node's
children are masked, so every reply is an admissible action. The policy *is* the masked
distribution: each token keeps the ids that were allowed, and the trainer scores it under the same mask.
"""

from __future__ import annotations

import torch

from agentkiln.policy.chat import LRU
from agentkiln.policy.model import Policy
from agentkiln.policy.prompt import render_action


class ActionTrie:
    """Prefix trie over token-id sequences; leaves map back to the action string."""

    def __init__(self, sequences: dict[str, list[int]]):
        self.root: dict = {}
        for action, ids in sequences.items():
            node = self.root
            for t in ids:
                node = node.setdefault(t, {})
            node.setdefault(None, action)  # first action wins if two share token ids

    def allowed(self, prefix: list[int]) -> list[int]:
        node = self.root
        for t in prefix:
            node = node[t]
        return sorted(k for k in node if k is not None)

    def action(self, ids: list[int]) -> str | None:
        """The action `ids` spell, or None while they are only a prefix."""
        node = self.root
        for t in ids:
            node = node.get(t)
            if node is None:
                return None
        return node.get(None)


class TrieCache:
    """A policy's constrained-decoding tries: each admissible action's reply ids (its text as the chat
    template renders it, native tool call or not) computed once per agent, whichever engine decodes."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._reply_ids = LRU()  # bounded: a server's clients send actions without end

    def __call__(self, admissible: list[str], tools: list[dict] | None) -> ActionTrie:
        return ActionTrie({a: self.reply_ids(a, tools) for a in admissible})

    def reply_ids(self, action: str, tools: list[dict] | None) -> list[int]:
        """The reply ids that perform `action` (a trie's path to it; rollout guidance forces them)."""
        return self._reply_ids.get_or_set((action, bool(tools)), lambda: self.policy.chat.reply(
            render_action(self.policy.fmt, action, tools)))


def sample(logits: torch.Tensor, allowed: list[list[int] | None], temperature: float, greedy: bool,
           generator: torch.Generator | None, forced: list[int | None] | None = None
           ) -> tuple[list[int], list[float], list[float]]:
    """One token per row of `logits` [B, V] (rows with an `allowed` list are masked to it): the
    tokens, their log-probs and the entropies of the distributions they were drawn from. A row whose
    `forced` entry is a token takes that token (the expert's, rollout guidance) with its log-prob
    under the same distribution; the draw is made for every row all the same, so forcing one row
    leaves the random stream of the others as it was."""
    z = logits.float() / temperature
    if any(a is not None for a in allowed):
        keep = torch.zeros_like(z, dtype=torch.bool)
        for r, a in enumerate(allowed):
            if a is None:
                keep[r] = True
            else:
                keep[r, a] = True
        z = z.masked_fill(~keep, float("-inf"))
    logp = z.log_softmax(-1)
    if greedy:
        tok = logp.argmax(-1)
    else:
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    if forced is not None and any(f is not None for f in forced):
        tok = torch.tensor([t if f is None else f for t, f in zip(tok.tolist(), forced)], device=tok.device)
    chosen = logp.gather(-1, tok[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return tok.tolist(), chosen.tolist(), entropy.tolist()
