"""Policy losses over flat tensors of action tokens (one entry per trained token).

Aggregation is DAPO's token-mean: every action token of the minibatch weighs the same.
"""

from __future__ import annotations

import torch


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict]:
    """-min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A), token-mean. clip_high > clip_low is
    DAPO's clip-higher."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    clip_frac = ((ratio < 1 - clip_low) & (adv < 0) | (ratio > 1 + clip_high) & (adv > 0)).float().mean()
    return loss, {"clip_frac": float(clip_frac), "ratio_mean": float(ratio.detach().mean())}


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1
