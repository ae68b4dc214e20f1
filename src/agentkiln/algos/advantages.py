"""Advantage estimators: GRPO / Dr.GRPO, RLOO, REINFORCE++ (-baseline), GAE, GiGPO (formulas in each docstring)."""

from __future__ import annotations

import torch

TIE_STD = 1e-6
"""Tie tolerance of every group-relative estimator: a group (or GiGPO step pool) whose rewards have
std <= TIE_STD * max(1, |group mean|) counts as tied and gets advantages of exactly 0. Rewards equal
in exact arithmetic need not be equal in float32 (eight rewards of 0.7: mean off by one ulp, std
6.4e-8), and (r - mean) / (std + 1e-6) would then give every member the same |A| = 0.056."""


def _tied(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """True where the pool's spread is rounding noise (see TIE_STD); a pool of one is always tied."""
    return std <= TIE_STD * mean.abs().clamp(min=1.0)


def _group_stats(values: torch.Tensor, keys: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry mean, unbiased std and size of the pool sharing its key."""
    mean, std, size = torch.zeros_like(values), torch.zeros_like(values), torch.zeros_like(values)
    pools: dict = {}
    for i, k in enumerate(keys):
        pools.setdefault(k, []).append(i)
    for idx in pools.values():
        v = values[idx]
        mean[idx] = v.mean()
        std[idx] = v.std() if len(idx) > 1 else 0.0
        size[idx] = float(len(idx))
    return mean, std, size


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g r) / (std_g r + eps), per episode.

    std is the unbiased sample std (as torch.std); a group of one, or a tied group (std within
    TIE_STD), gets exactly 0. With `norm_by_std=False` this is Dr.GRPO's A_i = r_i - mean_g r.
    """
    rewards = rewards.float()
    mean, std, _ = _group_stats(rewards, group_ids.tolist())
    centred = rewards - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return torch.where(_tied(mean, std), torch.zeros_like(adv), adv)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j over the other episodes of i's group (0 for a group of one
    or a tied group, see TIE_STD)."""
    rewards = rewards.float()
    mean, std, n = _group_stats(rewards, group_ids.tolist())
    others = (mean * n - rewards) / (n - 1).clamp(min=1)
    return torch.where(_tied(mean, std), torch.zeros_like(rewards), rewards - others)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var, as verl); 0 off the mask."""
    m = mask.bool()
    vals = x[m]
    var = vals.var() if vals.numel() > 1 else torch.tensor(0.0)
    return torch.where(m, (x - vals.mean()) * torch.rsqrt(var + eps), torch.zeros_like(x))


def reinforce_pp(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, baseline_group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++ per-token advantages, [B, T] -> [B, T], normalised over the whole batch.

    Without a baseline: the discounted return-to-go over action tokens,
    G_t = r_t + gamma * G_{t+1} (off-mask tokens neither earn nor carry return), then whitened
    over every masked token of the batch. Fold a -beta*KL term into `token_rewards` first.
    With `baseline_group_ids` (REINFORCE++-baseline, verl's reinforce_plus_plus_baseline): each
    sequence's score sum_t r_t minus its group's mean score (0 for a group of one or a tied group,
    see TIE_STD; verl keeps a lone sequence's raw score), broadcast over its tokens, then whitened
    the same way; `gamma` is not used.
    """
    r, m = token_rewards.float(), mask.float()
    if baseline_group_ids is not None:
        score = (r * m).sum(-1)
        mean, std, _ = _group_stats(score, baseline_group_ids.tolist())
        centred = torch.where(_tied(mean, std), torch.zeros_like(score), score - mean)
        returns = centred[:, None] * m
    else:
        returns = torch.zeros_like(r)
        running = torch.zeros(r.shape[0])
        for t in reversed(range(r.shape[1])):
            running = (r[:, t] + gamma * running) * m[:, t] + running * (1 - m[:, t])
            returns[:, t] = running * m[:, t]
    return masked_whiten(returns, m)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation along the last dimension (steps in order).

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t);  A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}.
    The value after the last step counts as 0 (episodes end or are truncated there). Returns
    (advantages, returns = advantages + values), the critic's regression target.
    """
    r, v, d = rewards.float(), values.float(), dones.float()
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[..., 0])
    next_adv = torch.zeros_like(r[..., 0])
    for t in reversed(range(r.shape[-1])):
        live = 1.0 - d[..., t]
        delta = r[..., t] + gamma * next_value * live - v[..., t]
        next_adv = delta + gamma * lam * live * next_adv
        adv[..., t] = next_adv
        next_value = v[..., t]
    return adv, adv + v


def gigpo(
    episode_rewards: torch.Tensor,
    group_ids: torch.Tensor,
    step_rewards: torch.Tensor,
    step_episode: torch.Tensor,
    step_anchor: list,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (verl-agent): per-step A = A^E + step_weight * A^S.

    A^E: the GRPO advantage of the step's episode within its group. A^S: the step's discounted
    return R_t = sum_{k>=t} gamma^(k-t) r_k (within its episode) against the pool of steps of the
    same group with the same anchor state, (R_t - mean) / (std + eps) (std unbiased); a pool of one
    or a tied pool (TIE_STD) gives 0. `norm_by_std` True is verl-agent's mode `mean_std_norm`, False
    its `mean_norm` (no std division at either level). Steps must be in order within each episode.
    """
    step_rewards = step_rewards.float()
    ep_adv = grpo(episode_rewards, group_ids, norm_by_std=norm_by_std, eps=eps)
    returns = torch.zeros_like(step_rewards)
    running: dict[int, float] = {}
    for i in reversed(range(len(step_rewards))):
        e = int(step_episode[i])
        running[e] = float(step_rewards[i]) + gamma * running.get(e, 0.0)
        returns[i] = running[e]
    keys = [(int(group_ids[int(e)]), a) for e, a in zip(step_episode.tolist(), step_anchor)]
    mean, std, _ = _group_stats(returns, keys)
    centred = returns - mean
    step_adv = centred / (std + eps) if norm_by_std else centred
    step_adv = torch.where(_tied(mean, std), torch.zeros_like(step_adv), step_adv)
    return ep_adv[step_episode.long()] + step_weight * step_adv


def scale_normalise(adv: torch.Tensor, keys: list, eps: float = 1e-6) -> torch.Tensor:
    """Multi-task balance (PopArt's per-task scale normalisation, Hessel et al. 2019, applied to
    advantages): each key's entries (a token's family or task type) divided by the root mean square
    of that key's entries, so every key's advantages have RMS 1 whatever its reward scale or how
    peaked its groups are. Signs and the ranking within a key are kept; a key whose entries are all
    (near) 0 stays 0."""
    out = adv.clone()
    for k in dict.fromkeys(keys):
        idx = torch.tensor([i for i, x in enumerate(keys) if x == k], dtype=torch.long)
        rms = adv[idx].pow(2).mean().sqrt()
        if rms > eps:
            out[idx] = adv[idx] / rms
    return out


def weight_positive(adv: torch.Tensor, weight: float) -> torch.Tensor:
    """W-REINFORCE's asymmetry (Zhu et al. 2025): positive advantages times `weight`, negative ones
    kept. With weight < 1 an update mostly pushes probability away from what lost, letting the policy
    redistribute it, instead of pulling it onto the tokens of the samples that won."""
    return torch.where(adv > 0, adv * weight, adv)
