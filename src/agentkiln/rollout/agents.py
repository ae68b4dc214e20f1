"""Agents reply to the latest observation of each active episode: the LM policy (one token sequence
per episode; its tokens from a generator: the in-process model with its KV cache kept across turns,
or vLLM) and the random-action baseline.

`act(episodes, envs)` returns one reply text per episode (None: the episode can no longer go on),
the engine parses and steps it. The policy agent also writes each episode's token ids: the
observation pieces it appends and the reply ids exactly as sampled, with their log-probs.
"""

from __future__ import annotations

import random
from typing import Protocol

import torch

from agentkiln.envs import Env
from agentkiln.policy.device import generator
from agentkiln.policy.model import Policy
from agentkiln.rollout.decoding import ActionTrie, TrieCache, sample
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
    """A policy replying in its chat template: each episode's latest observation appended to its token
    sequence (a new window when the context is full; cut when even that cannot fit), the reply decoded
    per family (constrained to the admissible actions through a token trie, or free up to the reply
    budget) by a generator, and written back with its ids, log-probs and the tokens allowed at each step.

    The generator is where the reply tokens come from (the `Generator` protocol): `HFGenerator` (the
    in-process model, one KV cache per chunk of episodes kept across turns, the default) or vLLM
    (rollout.vllm_backend.VLLMGenerator); everything else is this one agent."""

    def __init__(self, policy: Policy, temperature: float = 1.0, greedy: bool = False, seed: int = 0,
                 batch_size: int = 64, decoding: dict[str, str] | None = None, max_reply_tokens: int | None = None,
                 generator: Generator | None = None):
        self.policy, self.batch_size = policy, batch_size
        self.decoding = dict(decoding or {})
        for family, mode in self.decoding.items():
            if mode not in (*DECODING_MODES, "auto"):
                raise ValueError(f"decoding.{family} = {mode!r}: expected constrained, free or auto")
        self.max_reply_tokens = max_reply_tokens
        self.gen = generator or HFGenerator(policy, temperature, greedy, seed)
        self._trie = TrieCache(policy)

    def begin(self, episodes: list[Episode]) -> None:
        """A chunk of episodes played in lockstep."""
        self.row = {id(ep): r for r, ep in enumerate(episodes)}
        self.gen.begin(len(episodes))

    def act(self, episodes: list[Episode], envs: list[Env]) -> list[str | None]:
        out: list[str | None] = [None] * len(episodes)
        live = []
        for k, (ep, env) in enumerate(zip(episodes, envs)):
            budget = self.max_reply_tokens or env.max_reply_tokens
            tools = env.tool_specs() if self.policy.fmt.native_tools else None
            status = add_observation(ep, self.policy, budget, tools)
            if status == NEW_WINDOW:
                self.gen.restart(self.row[id(ep)])
            if status != CUT:  # cut episodes leave the batch now
                live.append((k, ep, budget, tools))
        if not live:
            return out
        tries = []
        for _, ep, _, tools in live:
            adm = ep.turns[-1].admissible
            constrained = decoding_mode(self.decoding, ep.family, adm) == "constrained"
            tries.append(self._trie(adm, tools) if constrained else None)
        eps = [ep for _, ep, _, _ in live]
        forced = [self._expert_ids(ep, envs[k], trie, tools, budget) for (k, ep, budget, tools), trie in zip(live, tries)]
        extra = {"forced": forced} if any(f is not None for f in forced) else {}
        replies = self.gen.replies(eps, [self.row[id(ep)] for ep in eps], tries, [b for _, _, b, _ in live], **extra)
        for (k, ep, _, _), trie, (ids, lps, ents, allowed) in zip(live, tries, replies):
            add_reply(ep, ids, lps, ents, allowed if trie else None)
            out[k] = trie.action(ids) if trie else self.policy.chat.decode(ids)
        return out

    def _expert_ids(self, ep: Episode, env: Env, trie: ActionTrie | None, tools: list[dict] | None,
                    budget: int) -> list[int] | None:
        """Rollout guidance: the reply ids of the expert's action when the expert plays this turn of
        `ep` (its `guide_at` reached, the expert able to act, the action one the policy could decode
        here); the turn is marked guided. None: the policy replies itself."""
        if ep.guide_at is None or len(ep.turns) - 1 < ep.guide_at:
            return None
        action = env.expert_action()
        if action is None:
            return None
        ids = self._trie.reply_ids(action, tools)
        if (trie is not None and trie.action(ids) != action) or (trie is None and len(ids) > budget):
            return None
        ep.turns[-1].guided = True
        return ids


class Generator(Protocol):
    """Reply tokens for a chunk's live episodes: `replies(episodes, rows, tries, budgets)` returns per
    episode (ids, log-probs, entropies, the ids allowed at each step); the prompt is each episode's
    current window (`Episode.window_ids`). `begin(n)` starts a chunk of n rows; `restart(row)`: the
    row's episode opened a new window. `forced` (rollout guidance; passed only when some reply is
    forced): per episode the reply ids to emit instead of sampling, or None."""

    def begin(self, n: int) -> None: ...
    def restart(self, row: int) -> None: ...
    def replies(self, episodes: list[Episode], rows: list[int], tries: list[ActionTrie | None],
                budgets: list[int], forced: list[list[int] | None] | None = None
                ) -> list[tuple[list[int], list[float], list[float], list[list[int]]]]: ...


class HFGenerator:
    """The in-process model: the chunk's rows share one KV cache (rollout.kv) kept across turns, fed only
    the tokens each row's window gained since; every row samples one token per step in lockstep,
    masked to the trie's allowed tokens where constrained (rollout.decoding.sample)."""

    def __init__(self, policy: Policy, temperature: float, greedy: bool, seed: int):
        self.policy, self.temperature, self.greedy = policy, temperature, greedy
        self.generator = generator(policy.device, seed)  # on the logits' device: same seed, same episodes

    def begin(self, n: int) -> None:
        self.kv = KVRows(self.policy.model, self.policy.pad_id, n)
        self.fed = [0] * n  # tokens of each row's current window already in the cache

    def restart(self, row: int) -> None:
        self.kv.restart(row)
        self.fed[row] = 0

    def replies(self, episodes, rows, tries, budgets, forced=None):
        self.policy.model.eval()
        with self.policy.autocast():
            return self._replies(episodes, rows, tries, budgets, forced or [None] * len(episodes))

    def _replies(self, episodes, rows, tries, budgets, forced):
        stop = self.policy.chat.stop_ids
        windows = [ep.window_ids(len(ep.windows) - 1) for ep in episodes]
        blocks = {r: w[self.fed[r]:] for r, w in zip(rows, windows)}
        self.kv.prepare(rows, [len(blocks[r]) for r in rows])
        logits = self.kv.feed(blocks)
        n = len(episodes)
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        ents: list[list[float]] = [[] for _ in range(n)]
        allowed_log: list[list[list[int]]] = [[] for _ in range(n)]
        live = list(range(n))
        while live:
            allowed = [tries[k].allowed(ids[k]) if tries[k] else None for k in live]
            force = [forced[k][len(ids[k])] if forced[k] is not None else None for k in live]
            toks, lp, ent = sample(torch.stack([logits[rows[k]] for k in live]), allowed, self.temperature,
                                   self.greedy, self.generator, force)
            still = []
            for k, a, t, l, e in zip(live, allowed, toks, lp, ent):
                ids[k].append(t)
                lps[k].append(l)
                ents[k].append(e)
                if a is not None:
                    allowed_log[k].append(a)
                if not (t in stop or (tries[k] is None and len(ids[k]) >= budgets[k])):
                    still.append(k)
            live = still
            if live:
                logits = self.kv.step({rows[k]: ids[k][-1] for k in live})
        for k, r in enumerate(rows):
            self.fed[r] = len(windows[k]) + len(ids[k]) - 1  # the last token goes in with the next piece
        return list(zip(ids, lps, ents, allowed_log))


class RandomAgent:
    """Uniform over the admissible actions: the floor every trained policy must clear. On a free-form
    family (no admissible list) it replies nothing, which the environment counts as invalid."""

    batch_size = None

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, episodes: list[Episode], envs: list[Env]) -> list[str]:
        return [self.rng.choice(ep.turns[-1].admissible) if ep.turns[-1].admissible else "" for ep in episodes]
