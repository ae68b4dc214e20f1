"""From played episodes to one advantage per generated token, for each RL algorithm.

    episodes --shape_rewards--> reward per turn --token_advantages(algorithm)--> advantage per token

Rewards are shaped per turn (invalid-action penalty, truncation penalty on the last turn of an
episode that ran out of turns, and optionally -kl_coef * KL folded in per token). Then:

- grpo / dr_grpo / rloo: one advantage per episode (its summed reward against its group),
  broadcast to every token of every turn;
- gigpo: one advantage per turn (episode-level group advantage + step_weight x the turn's
  discounted return against the turns of the same group from the same anchor state);
- reinforce_pp: per token, the return-to-go over the episode's action tokens (gamma = 1 per
  token: a turn-level discount does not apply), whitened over the batch;
- ppo: per turn, GAE over the episode's turns with the critic's values, whitened over the batch;
  the returns (advantages + values) are the critic's targets.

The estimators themselves are the pure functions in agentkiln.algos.advantages.
"""

from __future__ import annotations

import torch

from agentkiln.algos import advantages as A
from agentkiln.config import RLParams
from agentkiln.rollout.engine import Episode

EPISODE_LEVEL = ("grpo", "dr_grpo", "rloo")


def shape_rewards(episodes: list[Episode], p: RLParams, token_kl: list[list[list[float]]] | None = None
                  ) -> list[list[list[float]]]:
    """Reward of every token: each turn's (shaped) reward sits on its last token; with `token_kl`
    (kl_in_reward) every token also gets -kl_coef * its KL estimate."""
    out = []
    for e, ep in enumerate(episodes):
        turns = []
        for t, turn in enumerate(ep.turns):
            r = turn.reward + (p.invalid_penalty if turn.invalid else 0.0)
            if t == len(ep.turns) - 1 and ep.truncated:
                r += p.truncation_penalty
            tok = [0.0] * len(turn.gen.ids)
            if token_kl is not None:
                tok = [-p.kl_coef * k for k in token_kl[e][t]]
            if tok:
                tok[-1] += r
            turns.append(tok)
        out.append(turns)
    return out


def _broadcast(episodes: list[Episode], per_turn: list[list[float]]) -> list[list[list[float]]]:
    return [[[a] * len(turn.gen.ids) for turn, a in zip(ep.turns, adv)] for ep, adv in zip(episodes, per_turn)]


def token_advantages(
    algorithm: str, episodes: list[Episode], token_rewards: list[list[list[float]]], p: RLParams,
    values: list[list[float]] | None = None,
) -> tuple[list[list[list[float]]], list[list[float]] | None]:
    """(advantage per token [episode][turn][token], critic returns per turn or None)."""
    groups = torch.tensor([ep.group for ep in episodes])
    turn_rewards = [[sum(tok) for tok in ep_tok] for ep_tok in token_rewards]
    ep_rewards = torch.tensor([sum(r) for r in turn_rewards])
    if algorithm in EPISODE_LEVEL:
        if algorithm == "rloo":
            adv = A.rloo(ep_rewards, groups)
        else:
            adv = A.grpo(ep_rewards, groups, norm_by_std=algorithm == "grpo")
        return _broadcast(episodes, [[a] * len(ep.turns) for ep, a in zip(episodes, adv.tolist())]), None
    if algorithm == "gigpo":
        step_r = torch.tensor([r for rs in turn_rewards for r in rs])
        step_ep = torch.tensor([e for e, ep in enumerate(episodes) for _ in ep.turns])
        anchors = [t.anchor for ep in episodes for t in ep.turns]
        flat = A.gigpo(ep_rewards, groups, step_r, step_ep, anchors, gamma=p.gamma, step_weight=p.step_weight).tolist()
        per_turn, i = [], 0
        for ep in episodes:
            per_turn.append(flat[i : i + len(ep.turns)])
            i += len(ep.turns)
        return _broadcast(episodes, per_turn), None
    if algorithm == "reinforce_pp":
        seqs = [[r for tok in ep_tok for r in tok] for ep_tok in token_rewards]
        width = max(map(len, seqs))
        r = torch.zeros(len(seqs), width)
        m = torch.zeros(len(seqs), width)
        for i, s in enumerate(seqs):
            r[i, : len(s)] = torch.tensor(s)
            m[i, : len(s)] = 1.0
        adv = A.reinforce_pp(r, m, gamma=1.0)
        out = []
        for i, ep_tok in enumerate(token_rewards):
            flat, k, turns = adv[i].tolist(), 0, []
            for tok in ep_tok:
                turns.append(flat[k : k + len(tok)])
                k += len(tok)
            out.append(turns)
        return out, None
    if algorithm == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's values of every turn")
        width = max(len(ep.turns) for ep in episodes)
        r, v, d = torch.zeros(len(episodes), width), torch.zeros(len(episodes), width), torch.ones(len(episodes), width)
        for i, ep in enumerate(episodes):
            n = len(ep.turns)
            r[i, :n] = torch.tensor(turn_rewards[i])
            v[i, :n] = torch.tensor(values[i])
            d[i, : n - 1] = 0.0  # the last turn ends the episode (a truncation is treated as an end)
        adv, ret = A.gae(r, v, d, gamma=p.gamma, lam=p.gae_lambda)
        mask = torch.zeros_like(r)
        for i, ep in enumerate(episodes):
            mask[i, : len(ep.turns)] = 1.0
        adv = A.masked_whiten(adv, mask)
        per_turn = [adv[i, : len(ep.turns)].tolist() for i, ep in enumerate(episodes)]
        returns = [ret[i, : len(ep.turns)].tolist() for i, ep in enumerate(episodes)]
        return _broadcast(episodes, per_turn), returns
    raise ValueError(f"rl algorithm {algorithm!r}: expected one of grpo, dr_grpo, rloo, reinforce_pp, gigpo, ppo")
