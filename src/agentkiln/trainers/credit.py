"""From played episodes to the batch's advantage column, for each RL algorithm.

    turn rewards (shaped) --per algorithm--> advantage per turn or per token --> batch.advantages [R, T]

Turn rewards: the stage's reward components (agentkiln.rewards: the verifier's outcome, penalties,
shaping, a learned process reward, a judge; `p.reward`); with `kl_in_reward`, every reply token also
gets -kl_coef * its KL estimate to the reference (a turn's reward then includes its tokens' penalties).

- grpo / dr_grpo / rloo: one advantage per episode (its summed reward against its group), on every
  reply token of the episode;
- gigpo: one advantage per turn (episode-level group advantage + step_weight x the turn's
  discounted return against the turns of the same group from the same anchor state), each divided
  by its group's std or not (`gigpo_mode` mean_std_norm / mean_norm);
- reinforce_pp: per token, the return-to-go over the episode's reply tokens (gamma = 1 per token),
  whitened over the batch;
- reinforce_pp_baseline: the episode's score minus its group's mean score on every reply token,
  whitened over the batch;
- ppo: per turn, GAE over the episode's turns with the critic's values (read where the turn's reply
  starts), whitened over the batch; returns (advantages + values) are the critic's targets.

With `adv_norm` (family / task_type), each family's (type's) token advantages are then divided by
their root mean square (algos.advantages.scale_normalise): multi-task balance.

The estimators are the pure functions of agentkiln.algos.advantages; this module only lays the
batch's turns and tokens out for them and writes the result back.
"""

from __future__ import annotations

import torch

from agentkiln import rewards as R
from agentkiln.algos import advantages as A
from agentkiln.config import ALGORITHMS, RLParams
from agentkiln.rewards import RewardState
from agentkiln.rollout.episode import Episode
from agentkiln.trainers.batch import Batch

EPISODE_LEVEL = ("grpo", "dr_grpo", "rloo")


def shaped_turn_rewards(episodes: list[Episode], p: RLParams, rewards: RewardState | None = None
                        ) -> list[list[float]]:
    """Each turn's reward: the stage's reward components (`rewards`: the trainer's reward state; None:
    a fresh one, enough for every component but a trained process model or a judge)."""
    return R.turn_rewards(episodes, p.reward, rewards or RewardState(p))[0]


def turn_rewards(batch: Batch, episodes: list[Episode], p: RLParams, token_kl: torch.Tensor | None = None,
                 rewards: RewardState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per turn index of the batch: episode, shaped reward (KL penalties of its tokens folded in)."""
    shaped = shaped_turn_rewards(episodes, p, rewards)
    ep_of = torch.tensor([e for e, _ in batch.turns], dtype=torch.long)
    reward = torch.tensor([shaped[e][k] for e, k in batch.turns])
    if token_kl is not None:
        reward = reward.index_add(0, batch.flat(batch.turn_index), -p.kl_coef * token_kl)
    return ep_of, reward


def advantages(batch: Batch, episodes: list[Episode], p: RLParams, token_kl: torch.Tensor | None = None,
               values: torch.Tensor | None = None, rewards: RewardState | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantage of every reply token [R, T], critic targets per turn index [M] or None).
    `token_kl`: flat [N] KL estimates (kl_in_reward); `values`: critic value per turn index [M] (ppo);
    `rewards`: the trainer's reward state (shaped_turn_rewards).
    Every turn of every episode must be in the batch (turn indices cover episodes in order)."""
    rewards = rewards or RewardState(p)
    ep_of, turn_r = turn_rewards(batch, episodes, p, token_kl, rewards)
    n_eps = len(episodes)
    ep_r = torch.zeros(n_eps).index_add(0, ep_of, turn_r)
    groups = torch.tensor([ep.group for ep in episodes])
    tok_turn = batch.flat(batch.turn_index)
    returns = None
    if p.algorithm in EPISODE_LEVEL:
        adv_ep = A.rloo(ep_r, groups) if p.algorithm == "rloo" else A.grpo(ep_r, groups, norm_by_std=p.algorithm == "grpo")
        tok_adv = adv_ep[ep_of][tok_turn]
    elif p.algorithm == "gigpo":
        anchors = [episodes[e].turns[k].anchor for e, k in batch.turns]
        adv_turn = A.gigpo(ep_r, groups, turn_r, ep_of, anchors, gamma=p.gamma, step_weight=p.step_weight,
                           norm_by_std=p.gigpo_mode == "mean_std_norm")
        tok_adv = adv_turn[tok_turn]
    elif p.algorithm in ("reinforce_pp", "reinforce_pp_baseline"):
        tok_r = torch.zeros(len(tok_turn))
        last = torch.ones(len(tok_turn), dtype=torch.bool)
        last[:-1] = tok_turn[1:] != tok_turn[:-1]  # a turn's last reply token carries its reward
        tok_r[last] = turn_rewards(batch, episodes, p, rewards=rewards)[1][tok_turn[last]]  # KL goes on every token
        if token_kl is not None:
            tok_r = tok_r - p.kl_coef * token_kl
        r, m = _by_episode(tok_r, ep_of[tok_turn], n_eps)
        baseline = groups if p.algorithm == "reinforce_pp_baseline" else None
        tok_adv = A.reinforce_pp(r, m, gamma=1.0, baseline_group_ids=baseline)[m.bool()]
    elif p.algorithm == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's value of every turn")
        step = torch.tensor([k for _, k in batch.turns])
        width = int(step.max()) + 1
        r, v, done = torch.zeros(n_eps, width), torch.zeros(n_eps, width), torch.ones(n_eps, width)
        r[ep_of, step], v[ep_of, step] = turn_r, values
        n_turns = torch.zeros(n_eps, dtype=torch.long).index_add(0, ep_of, torch.ones_like(ep_of))
        mask = (torch.arange(width)[None, :] < n_turns[:, None]).float()
        done = torch.where(torch.arange(width)[None, :] < (n_turns - 1)[:, None], 0.0, 1.0)  # the last turn ends it
        adv, ret = A.gae(r, v, done, gamma=p.gamma, lam=p.gae_lambda)
        adv = A.masked_whiten(adv, mask)
        tok_adv = adv[ep_of, step][tok_turn]
        returns = ret[ep_of, step]
    else:
        raise ValueError(f"rl algorithm {p.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    if p.adv_norm != "none":
        key = [getattr(ep, p.adv_norm) or ep.family for ep in episodes]
        tok_adv = A.scale_normalise(tok_adv.float(), [key[int(e)] for e in ep_of[tok_turn]])
    out = torch.zeros(batch.loss_mask.shape)
    out[batch.loss_mask] = tok_adv.float()
    return out, returns


def _by_episode(values: torch.Tensor, episode: torch.Tensor, n_eps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token values (episodes contiguous, in order) -> [E, L] padded, and its mask."""
    counts = torch.zeros(n_eps, dtype=torch.long).index_add(0, episode, torch.ones_like(episode))
    width = int(counts.max()) if len(counts) else 0
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(len(episode)) - starts[episode]
    out, mask = torch.zeros(n_eps, width), torch.zeros(n_eps, width)
    out[episode, col] = values
    mask[episode, col] = 1.0
    return out, mask
