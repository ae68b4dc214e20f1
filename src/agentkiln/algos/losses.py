"""Policy losses over flat tensors of action tokens (one entry per trained token).

`seq_ids` (the sequence each token belongs to) is only needed by the sequence-level
aggregations and by GSPO; the default aggregation is DAPO's token-mean, where every action
token of the minibatch weighs the same.

Clamps, as verl's core_algos: the PPO log-ratio to [-20, 20] before `exp` (float32 `exp` overflows
past ~88, and inf * 0 is nan), GSPO's sequence log-ratio to at most 10, and k3's log-ratio to
[-20, 20] and its value to [-10, 10]. A clamped token gets no gradient through the clamped term.
"""

from __future__ import annotations

import torch

from agentkiln.algos.registry import register_policy_loss

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # |log pi - log pi_old| of PPO-clip and |log ref - log pi| inside k3 (verl)
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of GSPO's sequence log-ratio (verl)
K3_CLAMP = 10.0  # |k3| per token (verl's low_var_kl)


def aggregate(
    token_loss: torch.Tensor, mode: str = "token-mean", seq_ids: torch.Tensor | None = None, norm_len: float | None = None
) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean:              sum_{i,t} l / n_tokens (DAPO);
    seq-mean-token-mean:     mean_i (mean_t l_{i,t}) (GRPO as published);
    seq-mean-token-sum:      mean_i (sum_t l_{i,t}) (verl's seq-mean-token-sum);
    seq-mean-token-sum-norm: sum_{i,t} l / (n_seqs * norm_len) (Dr.GRPO: a constant length L
                             instead of each |o_i|). The trainer passes RLParams.loss_agg_norm_len;
                             without `norm_len` the longest sequence given is used, which varies
                             from batch to batch (verl: loss_scale_factor, else the padded width).
    """
    if mode == "token-mean":
        return token_loss.mean()
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation {mode!r}: expected one of {', '.join(AGG_MODES)}")
    if seq_ids is None:
        raise ValueError(f"loss aggregation {mode!r} needs seq_ids (the sequence of every token)")
    _, inverse, counts = torch.unique(seq_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=token_loss.dtype).index_add(0, inverse, token_loss)
    if mode == "seq-mean-token-mean":
        return (sums / counts).mean()
    if mode == "seq-mean-token-sum":
        return sums.mean()
    return sums.sum() / (len(counts) * float(norm_len if norm_len is not None else counts.max()))


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    seq_ids: torch.Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """-min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A) per token, then `aggregate`.

    rho = exp(clamp(logp - old_logp, -20, 20)) (LOG_RATIO_CLAMP, as verl: the loss stays finite).
    clip_high > clip_low is DAPO's clip-higher. `dual_clip` = c (> 1, typically 3) bounds the loss
    of negative-advantage tokens at -c*A, so one huge ratio cannot dominate the update.
    """
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    loss = aggregate(token_loss, agg, seq_ids, norm_len)
    clip_frac = ((ratio < 1 - clip_low) & (adv < 0) | (ratio > 1 + clip_high) & (adv > 0)).float().mean()
    return loss, {"clip_frac": float(clip_frac), "ratio_mean": float(ratio.detach().mean())}


def gspo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_ids: torch.Tensor,
    clip_low: float = 3e-4, clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict]:
    """GSPO: one importance ratio per sequence, s_i = exp(min(mean_t (logp - old_logp), 10)) (the
    clamp as verl's), clipped; loss = mean_i -min(s_i A_i, clip(s_i) A_i). A_i is the mean of the
    sequence's token advantages (they are equal under outcome rewards). Clip ranges are tiny because
    s_i is a geometric mean."""
    _, inverse, counts = torch.unique(seq_ids, return_inverse=True, return_counts=True)
    n = len(counts)
    log_ratio = torch.zeros(n, dtype=logp.dtype).index_add(0, inverse, logp - old_logp) / counts
    log_ratio = log_ratio.clamp(max=GSPO_LOG_RATIO_MAX)
    seq_adv = torch.zeros(n, dtype=adv.dtype).index_add(0, inverse, adv) / counts
    s = torch.exp(log_ratio)
    loss = -torch.minimum(s * seq_adv, s.clamp(1 - clip_low, 1 + clip_high) * seq_adv).mean()
    clip_frac = ((s < 1 - clip_low) & (seq_adv < 0) | (s > 1 + clip_high) & (seq_adv > 0)).float().mean()
    return loss, {"clip_frac": float(clip_frac), "ratio_mean": float(s.detach().mean())}


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref per token: unbiased for KL(pi || ref) on pi's samples, can be negative."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2 per token: biased, low variance, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 >= 0 with
    d = clamp(ref - logp, -20, 20), the result clamped to [-10, 10] (verl's low_var_kl)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-K3_CLAMP, K3_CLAMP)


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log pi - log ref| per token (verl's `abs`): >= 0, biased."""
    return (logp - ref_logp).abs()


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate by name: use it as a loss term, or subtract beta * it (detached)
    from the token rewards to fold it into the reward (REINFORCE++ style)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator {kind!r}: expected one of {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


def entropy_bonus(
    entropy: torch.Tensor, coef: float, agg: str = "token-mean", seq_ids: torch.Tensor | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """The term the trainer adds to the loss for an entropy bonus: -coef * the token entropies
    reduced by the loss's own aggregation (`aggregate`; token-mean: -coef * mean entropy)."""
    return -coef * aggregate(entropy, agg, seq_ids, norm_len)


def loglinear_proximal(behaviour_logp: torch.Tensor, logp: torch.Tensor, lag: torch.Tensor, steps: int) -> torch.Tensor:
    """The proximal policy's log-probs without a forward pass of their own (AReaL's `prox_logp_method:
    loglinear`): log pi_prox = log pi_b + alpha (log pi_theta - log pi_b), alpha = (v_prox - v_b) /
    (v_theta - v_b). Versions count optimizer steps: `lag` = v_prox - v_b per token (0: the behaviour
    policy is the proximal one), `steps` = v_theta - v_prox, the steps this update has taken. So alpha is
    1 on an update's first minibatch (pi_theta is pi_prox: exact) and 0 for a lag of 0 (exact); between,
    the log-probs move linearly in the steps. `logp` is detached: the proximal policy is a constant."""
    lag = lag.to(logp.dtype)
    alpha = torch.where(lag > 0, lag / (lag + steps), torch.zeros_like(lag))
    return behaviour_logp + alpha * (logp.detach() - behaviour_logp)


# --------------------------------------------------------------------------- registered by name (rl.policy_loss)
@register_policy_loss("ppo", token_level=True)
def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_ids: torch.Tensor, p) -> tuple[torch.Tensor, dict]:
    """rl.policy_loss ppo: `ppo_clip` with the stage's clip range, dual clip and aggregation."""
    return ppo_clip(logp, old_logp, adv, p.clip_low, p.clip_high, p.dual_clip, p.loss_agg, seq_ids,
                    float(p.loss_agg_norm_len))


@register_policy_loss("gspo", token_level=False)
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_ids: torch.Tensor, p) -> tuple[torch.Tensor, dict]:
    """rl.policy_loss gspo: `gspo` with the stage's clip range (its own sequence-level aggregation)."""
    return gspo(logp, old_logp, adv, seq_ids, p.clip_low, p.clip_high)
