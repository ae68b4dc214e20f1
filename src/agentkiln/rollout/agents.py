"""Agents reply to the latest observation of each active episode: the LM policy (one token sequence
per episode, its KV cache kept across turns) and the random-action baseline.

`act(episodes, envs)` returns one reply text per episode (None: the episode can no longer go on),
the engine parses and steps it. The policy agent also writes each episode's token ids: the
observation pieces it appends and the reply ids exactly as sampled, with their log-probs.
"""

from __future__ import annotations

import random

import torch

from agentkiln.envs import Env
from agentkiln.policy.device import generator
from agentkiln.policy.model import Policy
from agentkiln.rollout.decoding import TrieCache, sample
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.kv import KVRows
from agentkiln.rollout.sequence import CUT, NEW_WINDOW, add_observation, add_reply

DECODING_MODES = ("constrained", "free")


def decoding_mode(decoding: dict[str, str], family: str, admissible: list[str] | None) -> str:
    """A family's decoding: its entry in `decoding`, else the `default` entry, else constrained
    when the family lists admissible actions and free when it does not (tool families)."""
    mode = decoding.get(family, decoding.get("default", "auto"))
    if mode == "constrained" and not admissible:
        return "free"  # nothing to constrain to
    if mode == "auto":
        return "constrained" if admissible else "free"
    return mode


class PolicyAgent:
    def __init__(self, policy: Policy, temperature: float = 1.0, greedy: bool = False, seed: int = 0,
                 batch_size: int = 64, decoding: dict[str, str] | None = None, max_reply_tokens: int | None = None):
        self.policy, self.temperature, self.greedy, self.batch_size = policy, temperature, greedy, batch_size
        self.decoding = dict(decoding or {})
        for family, mode in self.decoding.items():
            if mode not in (*DECODING_MODES, "auto"):
                raise ValueError(f"decoding.{family} = {mode!r}: expected constrained, free or auto")
        self.max_reply_tokens = max_reply_tokens
        self.generator = generator(policy.device, seed)  # on the logits' device: same seed, same episodes
        self._trie = TrieCache(policy)

    # -- a chunk of episodes played in lockstep --------------------------------------------------
    def begin(self, episodes: list[Episode]) -> None:
        self.kv = KVRows(self.policy.model, self.policy.pad_id, len(episodes))
        self.row = {id(ep): r for r, ep in enumerate(episodes)}
        self.fed = [0] * len(episodes)  # tokens of each row's current window already in the cache

    def act(self, episodes: list[Episode], envs: list[Env]) -> list[str | None]:
        self.policy.model.eval()
        with self.policy.autocast():
            return self._act(episodes, envs)

    def _act(self, episodes: list[Episode], envs: list[Env]) -> list[str | None]:
        rows = [self.row[id(ep)] for ep in episodes]
        budgets = [self.max_reply_tokens or env.max_reply_tokens for env in envs]
        go = [self._append_observation(r, ep, env, n) for r, ep, env, n in zip(rows, episodes, envs, budgets)]
        live = [k for k, ok in enumerate(go) if ok]  # cut episodes leave the batch now
        blocks = {}
        for k in live:
            ep = episodes[k]
            blocks[rows[k]] = ep.window_ids(len(ep.windows) - 1)[self.fed[rows[k]]:]
        self.kv.prepare([rows[k] for k in live], [len(blocks[rows[k]]) for k in live])
        out: list[str | None] = [None] * len(episodes)
        if live:
            texts = self._decode([episodes[k] for k in live], [rows[k] for k in live], [envs[k] for k in live],
                                 [budgets[k] for k in live], blocks)
            for k, text in zip(live, texts):
                out[k] = text
        return out

    def _append_observation(self, row: int, ep: Episode, env: Env, reply_budget: int) -> bool:
        """Append the latest observation's ids; a new window restarts the row's cache. False: cut."""
        tools = env.tool_specs() if self.policy.fmt.native_tools else None
        status = add_observation(ep, self.policy, reply_budget, tools)
        if status == NEW_WINDOW:
            self.kv.restart(row)
            self.fed[row] = 0
        return status != CUT

    # -- replies ---------------------------------------------------------------------------------
    def _decode(self, episodes: list[Episode], rows: list[int], envs: list[Env], budgets: list[int],
                blocks: dict[int, list[int]]) -> list[str]:
        chat = self.policy.chat
        tries = []
        for ep, env in zip(episodes, envs):
            adm = ep.turns[-1].admissible
            constrained = decoding_mode(self.decoding, ep.family, adm) == "constrained"
            tools = env.tool_specs() if self.policy.fmt.native_tools else None
            tries.append(self._trie(adm, tools) if constrained else None)
        logits = self.kv.feed(blocks)
        n = len(episodes)
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        ents: list[list[float]] = [[] for _ in range(n)]
        allowed_log: list[list[list[int]]] = [[] for _ in range(n)]
        live = list(range(n))
        while live:
            allowed = [tries[k].allowed(ids[k]) if tries[k] else None for k in live]
            toks, lp, ent = sample(torch.stack([logits[rows[k]] for k in live]), allowed, self.temperature,
                                   self.greedy, self.generator)
            still = []
            for k, a, t, l, e in zip(live, allowed, toks, lp, ent):
                ids[k].append(t)
                lps[k].append(l)
                ents[k].append(e)
                if a is not None:
                    allowed_log[k].append(a)
                if not (t in chat.stop_ids or (tries[k] is None and len(ids[k]) >= budgets[k])):
                    still.append(k)
            live = still
            if live:
                logits = self.kv.step({rows[k]: ids[k][-1] for k in live})
        texts = []
        for k, ep in enumerate(episodes):
            add_reply(ep, ids[k], lps[k], ents[k], allowed_log[k] if tries[k] else None)
            self.fed[rows[k]] = ep.window_len(ep.turns[-1].window) - 1  # the last token goes in with the next piece
            texts.append(tries[k].action(ids[k]) if tries[k] else chat.decode(ids[k]))
        return texts


class RandomAgent:
    """Uniform over the admissible actions: the floor every trained policy must clear. On a free-form
    family (no admissible list) it replies nothing, which the environment counts as invalid."""

    batch_size = None

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, episodes: list[Episode], envs: list[Env]) -> list[str]:
        return [self.rng.choice(ep.turns[-1].admissible) if ep.turns[-1].admissible else "" for ep in episodes]
