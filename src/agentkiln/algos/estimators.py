"""The advantage estimators of `rl.algorithm`, registered by name (agentkiln.algos.registry): each lays
an iteration's turns and tokens out for the pure formulas of agentkiln.algos.advantages and returns
(the advantage of every reply token [N], the critic's targets per turn [M] or None).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkiln.algos import advantages as A
from agentkiln.algos.registry import register_estimator


@dataclass
class Credit:
    """What an estimator reads: one iteration's turns (M, episodes contiguous and in order) and reply
    tokens (N, in batch order), as flat tensors."""
    episode_reward: torch.Tensor  # [E] summed turn rewards (KL penalties folded in)
    group: torch.Tensor           # [E] group id (episodes of one task from one initial state)
    turn_reward: torch.Tensor     # [M] shaped turn reward, KL penalties of its tokens folded in (kl_in_reward)
    turn_reward_shaped: torch.Tensor  # [M] the same without the KL penalties
    turn_episode: torch.Tensor    # [M] the turn's episode
    turn_step: torch.Tensor       # [M] the turn's index within its episode
    turn_anchor: list             # [M] the state the turn acted from (GiGPO's step groups)
    token_turn: torch.Tensor      # [N] each reply token's turn
    token_kl: torch.Tensor | None  # [N] KL estimate per token x kl_coef (kl_in_reward), else None
    values: torch.Tensor | None   # [M] the critic's value per turn (estimators registered with needs_critic)

    @property
    def n_episodes(self) -> int:
        return len(self.episode_reward)


def _episode_level(adv_episode: torch.Tensor, c: Credit) -> torch.Tensor:
    return adv_episode[c.turn_episode][c.token_turn]


@register_estimator("grpo")
def grpo(c: Credit, p) -> tuple[torch.Tensor, None]:
    return _episode_level(A.grpo(c.episode_reward, c.group, norm_by_std=True), c), None


@register_estimator("dr_grpo")
def dr_grpo(c: Credit, p) -> tuple[torch.Tensor, None]:
    return _episode_level(A.grpo(c.episode_reward, c.group, norm_by_std=False), c), None


@register_estimator("rloo")
def rloo(c: Credit, p) -> tuple[torch.Tensor, None]:
    return _episode_level(A.rloo(c.episode_reward, c.group), c), None


@register_estimator("gigpo")
def gigpo(c: Credit, p) -> tuple[torch.Tensor, None]:
    adv_turn = A.gigpo(c.episode_reward, c.group, c.turn_reward, c.turn_episode, c.turn_anchor, gamma=p.gamma,
                       step_weight=p.step_weight, norm_by_std=p.gigpo_mode == "mean_std_norm")
    return adv_turn[c.token_turn], None


def _reinforce_pp(c: Credit, baseline: bool) -> torch.Tensor:
    tok_turn = c.token_turn
    tok_r = torch.zeros(len(tok_turn))
    last = torch.ones(len(tok_turn), dtype=torch.bool)
    last[:-1] = tok_turn[1:] != tok_turn[:-1]  # a turn's last reply token carries its reward
    tok_r[last] = c.turn_reward_shaped[tok_turn[last]]  # KL goes on every token
    if c.token_kl is not None:
        tok_r = tok_r - c.token_kl
    r, m = _by_episode(tok_r, c.turn_episode[tok_turn], c.n_episodes)
    return A.reinforce_pp(r, m, gamma=1.0, baseline_group_ids=c.group if baseline else None)[m.bool()]


@register_estimator("reinforce_pp")
def reinforce_pp(c: Credit, p) -> tuple[torch.Tensor, None]:
    return _reinforce_pp(c, baseline=False), None


@register_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(c: Credit, p) -> tuple[torch.Tensor, None]:
    return _reinforce_pp(c, baseline=True), None


@register_estimator("ppo", needs_critic=True)
def ppo(c: Credit, p) -> tuple[torch.Tensor, torch.Tensor]:
    if c.values is None:
        raise ValueError("ppo needs the critic's value of every turn")
    n_eps, ep_of, step = c.n_episodes, c.turn_episode, c.turn_step
    width = int(step.max()) + 1
    r, v = torch.zeros(n_eps, width), torch.zeros(n_eps, width)
    r[ep_of, step], v[ep_of, step] = c.turn_reward, c.values
    n_turns = torch.zeros(n_eps, dtype=torch.long).index_add(0, ep_of, torch.ones_like(ep_of))
    mask = (torch.arange(width)[None, :] < n_turns[:, None]).float()
    done = torch.where(torch.arange(width)[None, :] < (n_turns - 1)[:, None], 0.0, 1.0)  # the last turn ends it
    adv, ret = A.gae(r, v, done, gamma=p.gamma, lam=p.gae_lambda)
    adv = A.masked_whiten(adv, mask)
    return adv[ep_of, step][c.token_turn], ret[ep_of, step]


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
