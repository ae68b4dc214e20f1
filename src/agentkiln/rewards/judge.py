"""A local model as the judge of an episode, for tasks without a verifier.

The judge reads the episode (goal, then each observation and action) followed by the rubric, as one
user message of its chat template, and its verdict is P(yes) / (P(yes) + P(no)) of the first reply
token (`yes_token`, `no_token`). Scores are cached by a hash of the episode's text: a group's
identical episodes, or a re-scored batch, cost one forward pass. Where a verifier exists, `agreement`
measures how far the judge can be trusted (accuracy at 0.5 and correlation with `won`).
"""

from __future__ import annotations

import hashlib
import math

import torch

from agentkiln.policy.model import Policy, load_policy
from agentkiln.rewards.components import Context, component
from agentkiln.rollout.episode import Episode


def episode_text(ep: Episode) -> str:
    """What the judge reads of an episode."""
    lines = [f"Goal: {ep.goal}"]
    for k, t in enumerate(ep.turns):
        lines += [f"Observation {k + 1}: {t.observation}", f"Action {k + 1}: {t.action or t.reply}"]
    return "\n".join(lines)


class Judge:
    """Scores episodes against `rubric` with `policy` (settings: agentkiln.config.JudgeReward)."""

    def __init__(self, policy: Policy, rubric: str, yes_token: str = " yes", no_token: str = " no"):
        self.policy, self.rubric = policy, rubric
        tok = policy.tokenizer
        self.yes = tok.encode(yes_token, add_special_tokens=False)[0]
        self.no = tok.encode(no_token, add_special_tokens=False)[0]
        if self.yes == self.no:
            raise ValueError(f"judge verdicts {yes_token!r} and {no_token!r} start with the same token")
        self.cache: dict[str, float] = {}
        self.forward_passes = 0

    @classmethod
    def from_settings(cls, cfg, compute=None) -> Judge:
        """The judge of a `reward.judge` section (its `model` loaded with agentkiln.policy.load_policy)."""
        return cls(load_policy(cfg.model, compute=compute), cfg.rubric, cfg.yes_token, cfg.no_token)

    @torch.no_grad()
    def score(self, ep: Episode) -> float:
        """P(yes) of the verdict on the episode, in [0, 1]."""
        text = f"{episode_text(ep)}\n\n{self.rubric}"
        key = hashlib.sha1(text.encode()).hexdigest()
        if key not in self.cache:
            ids = self.policy.chat.start(text)[-self.policy.max_context :]  # the rubric is at the end: keep it
            self.policy.model.eval()
            with self.policy.autocast():
                logits = self.policy.model(torch.tensor([ids], device=self.policy.device)).logits[0, -1].float()
            pair = torch.log_softmax(logits, -1)[[self.yes, self.no]]
            self.cache[key] = float(torch.softmax(pair, -1)[0])
            self.forward_passes += 1
        return self.cache[key]


def agreement(scores: list[float], won: list[bool]) -> dict:
    """How the judge's scores agree with a verifier: accuracy of score > 0.5 against `won`, and the
    Pearson correlation of the scores with won (nan when either does not vary)."""
    n = len(scores)
    if n == 0 or n != len(won):
        raise ValueError(f"agreement: {n} scores for {len(won)} verdicts")
    acc = sum((s > 0.5) == w for s, w in zip(scores, won)) / n
    y = [float(w) for w in won]
    ms, my = sum(scores) / n, sum(y) / n
    cov = sum((s - ms) * (v - my) for s, v in zip(scores, y))
    var = math.sqrt(sum((s - ms) ** 2 for s in scores) * sum((v - my) ** 2 for v in y))
    return {"accuracy": acc, "correlation": cov / var if var > 0 else float("nan"), "n": n}


@component("judge")
def judge(ep: Episode, ctx: Context, cfg) -> list[float]:
    """The judge's P(yes) on the episode's last turn (0 on the others)."""
    if ctx.state.judge is None:
        raise ValueError("reward.judge needs a judge model: set reward.judge.model")
    out = [0.0] * len(ep.turns)
    if out:
        out[-1] = ctx.state.judge.score(ep)
    return out
