"""Advantage estimators (see shared/reference/agent-rl.md section 3)."""

from __future__ import annotations

import torch


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g r) / (std_g r + eps), per episode.

    std is the unbiased sample std (as torch.std); a group of one gets 0. With
    `norm_by_std=False` this is Dr.GRPO's A_i = r_i - mean_g r.
    """
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std() + eps) if norm_by_std else centred
    return adv
