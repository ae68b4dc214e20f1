"""A process reward learned online from the run's own episodes, without step labels.

An implicit PRM from trajectory preferences (OPRL-style): a step scorer r_k = tanh(w . x(s_k, a_k) + b),
x a hashed bag of word n-grams of the turn's observation, of its reply, and of (observation word,
reply) pairs (so a step is judged in its state), L2-normalised. Each iteration it is trained on the
(won, lost) episode pairs of the same group with a Bradley-Terry loss on the episodes' summed step
scores, -log sigmoid(sum_k r_k(won) - sum_k r_k(lost)): the steps that tell winners from losers get
the credit. Its step scores are turn rewards, in [-1, 1]. Tiny and deterministic: zero-initialised,
full-batch Adam, pairs subsampled with a seeded generator; `state_dict` checkpoints all of it.
"""

from __future__ import annotations

import random
import re
import zlib

import torch

from agentkiln.rewards.components import Context, component
from agentkiln.rollout.episode import Episode, Turn

_WORD = re.compile(r"\w+|[^\w\s]")


def _grams(words: list[str], n: int) -> list[str]:
    return [" ".join(words[i : i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1)]


def turn_features(turn: Turn, buckets: int, ngram: int) -> dict[int, float]:
    """Hashed feature counts of one (observation, reply) step (crc32: stable across processes)."""
    obs = _WORD.findall(turn.observation.lower())
    act = _WORD.findall((turn.action or turn.reply).lower())
    act_key = " ".join(act)
    names = [f"o:{g}" for g in _grams(obs, ngram)] + [f"a:{g}" for g in _grams(act, ngram)]
    names += [f"x:{w}|{act_key}" for w in set(obs)]
    out: dict[int, float] = {}
    for name in names:
        h = zlib.crc32(name.encode()) % buckets
        out[h] = out.get(h, 0.0) + 1.0
    return out


class ProcessModel:
    """The step scorer and its optimizer (settings: agentkiln.config.ProcessReward)."""

    def __init__(self, cfg, seed: int = 0):
        self.cfg = cfg
        self.linear = torch.nn.Linear(cfg.features, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.opt = torch.optim.Adam(self.linear.parameters(), lr=cfg.lr)
        self.rng = random.Random(seed)

    def features(self, turns: list[Turn]) -> torch.Tensor:
        """[turns, features], each row L2-normalised."""
        x = torch.zeros(len(turns), self.cfg.features)
        for i, turn in enumerate(turns):
            for j, v in turn_features(turn, self.cfg.features, self.cfg.ngram).items():
                x[i, j] = v
        return torch.nn.functional.normalize(x, dim=1)

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x).squeeze(-1))

    @torch.no_grad()
    def step_rewards(self, ep: Episode) -> list[float]:
        """r_k of every turn, in [-1, 1]."""
        return self._scores(self.features(ep.turns)).tolist() if ep.turns else []

    def pairs(self, episodes: list[Episode]) -> list[tuple[int, int]]:
        """(won, lost) index pairs of the same group, at most max_pairs (a seeded sample)."""
        groups: dict[int, list[int]] = {}
        for i, ep in enumerate(episodes):
            groups.setdefault(ep.group, []).append(i)
        out = [(w, lo) for idx in groups.values() for w in idx if episodes[w].won
               for lo in idx if not episodes[lo].won]
        if len(out) > self.cfg.max_pairs:
            out = self.rng.sample(out, self.cfg.max_pairs)
        return out

    def update(self, episodes: list[Episode]) -> dict:
        """`epochs` Bradley-Terry steps on this iteration's preference pairs; returns the last loss
        and the number of pairs (no pairs: nothing to learn, no step)."""
        pairs = self.pairs(episodes)
        if not pairs:
            return {"process_loss": 0.0, "process_pairs": 0}
        used = sorted({i for pair in pairs for i in pair})
        turns = [t for i in used for t in episodes[i].turns]
        x = self.features(turns)
        owner = torch.tensor([n for n, i in enumerate(used) for _ in episodes[i].turns], dtype=torch.long)
        pos = {i: n for n, i in enumerate(used)}
        win = torch.tensor([pos[w] for w, _ in pairs])
        lose = torch.tensor([pos[lo] for _, lo in pairs])
        loss = torch.tensor(0.0)
        for _ in range(self.cfg.epochs):
            totals = torch.zeros(len(used)).index_add(0, owner, self._scores(x))
            loss = -torch.nn.functional.logsigmoid(totals[win] - totals[lose]).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return {"process_loss": float(loss.detach()), "process_pairs": len(pairs)}

    def state_dict(self) -> dict:
        return {"linear": self.linear.state_dict(), "opt": self.opt.state_dict(), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.linear.load_state_dict(state["linear"])
        self.opt.load_state_dict(state["opt"])
        self.rng.setstate(state["rng"])


@component("process")
def process(ep: Episode, ctx: Context, cfg) -> list[float]:
    """The learned step scores r_k = tanh(f(s_k, a_k)) of the episode's turns."""
    if ctx.state.process is None:
        raise ValueError("reward.process: no process model in the reward state (made with reward.process.weight 0)")
    return ctx.state.process.step_rewards(ep)
