"""Advantage estimators and losses against values computed by hand."""

import math

import pytest
import torch

from agentkiln.algos.advantages import grpo
from agentkiln.algos.losses import kl_k3, ppo_clip


def test_grpo_hand_computed():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 1: rewards 1, 1 -> std 0 -> (r - mean) / eps = 0
    # group 2: a single episode -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = grpo(rewards, groups)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0], abs=1e-6)


def test_dr_grpo_has_no_std_division():
    adv = grpo(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5, 5, 5]), norm_by_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_ppo_clip_hand_computed():
    # token 1: ratio e^0.5 = 1.6487, A=+1 -> clipped at 1.28 -> -1.28
    # token 2: ratio e^-0.5 = 0.6065, A=-2 -> min(-1.2131, 0.8*-2=-1.6) = -1.6 -> +1.6
    # token 3: ratio 1, A=0.5 -> -0.5
    logp = torch.tensor([0.0, -1.0, -2.0])
    old = torch.tensor([-0.5, -0.5, -2.0])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, info = ppo_clip(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx((-1.28 + 1.6 - 0.5) / 3, abs=1e-5)
    assert info["clip_frac"] == pytest.approx(2 / 3)


def test_ppo_clip_gradient_is_policy_gradient_when_on_policy():
    logp = torch.tensor([-0.7, -0.2], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = ppo_clip(logp, logp.detach(), adv)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.5])  # -A / N


def test_k3_is_zero_at_reference_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -1.0, -0.1])
    ref = torch.tensor([-1.0, -2.0, -0.5])
    k = kl_k3(logp, ref)
    # d = ref - logp: 0 -> 0; -1 -> e^-1 + 1 - 1 = 0.367879; -0.4 -> e^-0.4 + 0.4 - 1 = 0.070320
    assert k.tolist() == pytest.approx([0.0, 0.367879, 0.070320], abs=1e-6)


# ---------------------------------------------------------------- RLOO, REINFORCE++, GAE, GiGPO
from agentkiln.algos.advantages import gae, gigpo, reinforce_pp, rloo  # noqa: E402


def test_rloo_hand_computed():
    # group 0 (1, 0, 0, 1): 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3; group 1 (2, 4): -2, +2; singleton: 0
    adv = rloo(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 5.0]), torch.tensor([0, 0, 0, 0, 1, 1, 2]))
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0], abs=1e-6)


def test_reinforce_pp_discounted_returns_whitened_over_the_batch():
    # gamma 0.5: row 0 returns (0.25, 0.5, 1); row 1 (1, 2, -) with its last token off the mask.
    # masked values 0.25 0.5 1 1 2: mean 0.95, unbiased var 1.8/4 = 0.45
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp(r, m, gamma=0.5)
    s = math.sqrt(0.45)
    want = [[(0.25 - 0.95) / s, (0.5 - 0.95) / s, (1 - 0.95) / s], [(1 - 0.95) / s, (2 - 0.95) / s, 0.0]]
    assert adv.flatten().tolist() == pytest.approx([x for row in want for x in row], abs=1e-5)


def test_reinforce_pp_ignores_rewards_off_the_mask_and_carries_return_across_them():
    # an observation token (mask 0) between two actions: its reward 5 is ignored, the return
    # passes over it: returns (0.5, -, 1) -> whitened (-1/sqrt2, 0, 1/sqrt2)
    adv = reinforce_pp(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    assert adv.flatten().tolist() == pytest.approx([-math.sqrt(0.5), 0.0, math.sqrt(0.5)], abs=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_score():
    # scores 1, 0 (group 0, mean 0.5) and 3 (group 1) -> 0.5, -0.5, 0 per token; unbiased var 1/5
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    adv = reinforce_pp(r, torch.ones(3, 2), baseline_group_ids=torch.tensor([0, 0, 1]))
    a = 0.5 / math.sqrt(0.2)
    assert adv.flatten().tolist() == pytest.approx([a, a, -a, -a, 0.0, 0.0], abs=1e-5)


def test_gae_hand_computed():
    # gamma 0.9, lam 0.8: delta_2 = 1 - 0.7 = 0.3 (terminal); delta_1 = 0.9*0.7 - 0.6 = 0.03,
    # A_1 = 0.03 + 0.72*0.3 = 0.246; delta_0 = 0.9*0.6 - 0.5 = 0.04, A_0 = 0.04 + 0.72*0.246
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.7]), torch.tensor([0, 0, 1]), 0.9, 0.8)
    assert adv.tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-6)
    assert ret.tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)


def test_gae_does_not_carry_across_episode_ends():
    # episodes [r=1] and [0, 2]: the first is done after one step and sees nothing of the second
    adv, _ = gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 1.0, 1.0]), torch.tensor([1, 0, 1]), 0.9, 0.8)
    assert adv.tolist() == pytest.approx([0.5, -0.1 + 0.72 * 1.0, 1.0], abs=1e-6)


def _gigpo_case(**kw):
    # group 0: e0 (won, anchors A B, step rewards 0 1), e1 (lost, anchors A C A: a loop back to A);
    # group 1: e2 alone, whose anchor A must not pool with group 0's A.
    return gigpo(
        episode_rewards=torch.tensor([1.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1]),
        step_rewards=torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 1.0]),
        step_episode=torch.tensor([0, 0, 1, 1, 1, 2]),
        step_anchor=["A", "B", "A", "C", "A", "A"],
        gamma=0.5,
        **kw,
    )


def test_gigpo_hand_computed_with_repeated_anchors_and_singleton_pools():
    # episode level: group 0 rewards (1, 0): +-0.5/std, std = sqrt(0.5); group 1 alone: 0.
    # step returns (gamma 0.5): e0 (0.5, 1), e1 (0, 0, 0), e2 (1).
    # pool (0, A) = {0.5, 0, 0}: mean 1/6, unbiased std sqrt(1/12) -> e0t0 +1.1547, e1t0 = e1t2 -0.57735;
    # pools (0, B), (0, C), (1, A) have one step each -> 0.
    e = 0.5 / math.sqrt(0.5)
    s = math.sqrt(1 / 12)
    want = [e + (0.5 - 1 / 6) / s, e, -e - (1 / 6) / s, -e, -e - (1 / 6) / s, 0.0]
    assert _gigpo_case().tolist() == pytest.approx(want, abs=1e-4)


def test_gigpo_mean_norm_and_step_weight():
    # no std division: episode +-0.5; step e0t0 0.5 - 1/6, e1t0 = e1t2 -1/6, weighted by 0.5
    want = [0.5 + 0.5 * (1 / 3), 0.5, -0.5 - 0.5 / 6, -0.5, -0.5 - 0.5 / 6, 0.0]
    assert _gigpo_case(norm_by_std=False, step_weight=0.5).tolist() == pytest.approx(want, abs=1e-6)


def test_gigpo_with_zero_step_weight_is_grpo_broadcast():
    adv = _gigpo_case(step_weight=0.0)
    ep = grpo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    assert adv.tolist() == pytest.approx(ep[torch.tensor([0, 0, 1, 1, 1, 2])].tolist())


# ---------------------------------------------------------------- aggregation, dual clip, GSPO, KL
from agentkiln.algos.losses import aggregate, entropy_bonus, gspo, kl_penalty  # noqa: E402


def test_aggregation_modes_hand_computed():
    # sequence 0 has one token (loss 1), sequence 1 three (2, 3, 6)
    loss, seq = torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([0, 1, 1, 1])
    assert float(aggregate(loss)) == pytest.approx(3.0)
    assert float(aggregate(loss, "seq-mean-token-mean", seq)) == pytest.approx((1 + 11 / 3) / 2)
    assert float(aggregate(loss, "seq-mean-token-sum-norm", seq)) == pytest.approx(12 / (2 * 3))
    assert float(aggregate(loss, "seq-mean-token-sum-norm", seq, norm_len=4)) == pytest.approx(12 / 8)
    with pytest.raises(ValueError, match="needs seq_ids"):
        aggregate(loss, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="'sum'"):
        aggregate(loss, "sum", seq)


def test_dual_clip_bounds_negative_advantage_loss():
    # token 1: ratio e^2 = 7.389, A = -1 -> PPO loss 7.389, dual clip c = 3 caps it at 3;
    # token 2: ratio 1, A = +0.5 -> -0.5 either way
    logp, old, adv = torch.tensor([0.0, -1.0]), torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, 0.5])
    plain, _ = ppo_clip(logp, old, adv, 0.2, 0.28)
    dual, _ = ppo_clip(logp, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert float(plain) == pytest.approx((math.exp(2) - 0.5) / 2, abs=1e-5)
    assert float(dual) == pytest.approx((3.0 - 0.5) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip(logp, old, adv, dual_clip=0.5)


def test_gspo_sequence_ratio_hand_computed():
    # seq 0: log-ratios (0.2, 0.0) -> s = e^0.1 = 1.105 > 1.05, A = +1 -> clipped: -1.05
    # seq 1: log-ratio -0.1 -> s = 0.905 < 0.95, A = -2 -> min(-1.8097, -1.9) = -1.9 -> +1.9
    logp, old = torch.tensor([0.2, 0.0, -0.1]), torch.zeros(3)
    adv, seq = torch.tensor([1.0, 1.0, -2.0]), torch.tensor([0, 0, 1])
    loss, info = gspo(logp, old, adv, seq, clip_low=0.05, clip_high=0.05)
    assert float(loss) == pytest.approx((-1.05 + 1.9) / 2, abs=1e-6)
    assert info["clip_frac"] == pytest.approx(1.0)


def test_kl_estimators_and_entropy_bonus_hand_computed():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(1.0)
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(math.exp(-1))  # e^-1 + 1 - 1
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")
    assert float(entropy_bonus(torch.tensor([1.0, 3.0]), 0.1)) == pytest.approx(-0.2)


# ---------------------------------------------------------------- numerics: clamps, ties, constants
from agentkiln.algos.advantages import TIE_STD  # noqa: E402


def test_ppo_log_ratio_is_clamped_to_20_so_a_log_ratio_of_100_gives_a_finite_loss():
    # token 1: log-ratio +100 -> 20, rho = e^20, A = -1: -min(-e^20, -1.28) = e^20 (unclamped: inf)
    # token 2: log-ratio +100, A = 0: 0 (unclamped: inf * 0 = nan)
    # token 3: log-ratio -100 -> -20, rho = e^-20, A = +1: -min(e^-20, 0.8) = -e^-20
    logp = torch.tensor([0.0, 0.0, -100.0], requires_grad=True)
    old, adv = torch.tensor([-100.0, -100.0, 0.0]), torch.tensor([-1.0, 0.0, 1.0])
    loss, info = ppo_clip(logp, old, adv, 0.2, 0.28)
    assert float(loss.detach()) == pytest.approx((math.exp(20) - math.exp(-20)) / 3, rel=1e-6)
    assert info["ratio_mean"] == pytest.approx((2 * math.exp(20) + math.exp(-20)) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [0.0, 0.0, 0.0]  # past the clamp no gradient flows (finite, not nan)
    dual, _ = ppo_clip(logp.detach(), old, adv, 0.2, 0.28, dual_clip=3.0)
    assert float(dual) == pytest.approx((3.0 - math.exp(-20)) / 3, abs=1e-6)
    # inside the clamp nothing changes: log-ratio 19 with A = -1 gives e^19
    assert float(ppo_clip(torch.tensor([0.0]), torch.tensor([-19.0]), torch.tensor([-1.0]))[0]) == pytest.approx(
        math.exp(19), rel=1e-6)


def test_gspo_sequence_log_ratio_is_clamped_at_10():
    # one sequence, mean log-ratio 100 -> 10: s = e^10, A = -1 -> -min(-e^10, -(1 - 3e-4)) = e^10 (unclamped: inf)
    loss, _ = gspo(torch.tensor([0.0, 0.0]), torch.tensor([-100.0, -100.0]), torch.tensor([-1.0, -1.0]),
                   torch.tensor([0, 0]))
    assert float(loss) == pytest.approx(math.exp(10), rel=1e-6)


def test_k3_clamps_its_log_ratio_and_its_value_and_abs_estimator():
    # d = ref - logp: -100 -> -20: e^-20 + 19 -> 10; +100 -> +20: e^20 - 21 -> 10 (unclamped: inf);
    # 3: e^3 - 4 = 16.0855 -> 10; 2: e^2 - 3 = 4.389056; -5: e^-5 + 4 = 4.006738 (under the clamps)
    logp = torch.tensor([0.0, -100.0, 0.0, 0.0, 0.0])
    ref = torch.tensor([-100.0, 0.0, 3.0, 2.0, -5.0])
    assert kl_k3(logp, ref).tolist() == pytest.approx([10.0, 10.0, 10.0, 4.389056, 4.006738], abs=1e-5)
    assert kl_penalty(logp, ref, "abs").tolist() == [100.0, 100.0, 3.0, 2.0, 5.0]
    assert float(kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "abs")) == 1.0


def test_tied_float32_group_gets_exactly_zero_advantage():
    # eight rewards of 0.7 in float32: their mean is off by one ulp (std 6.4e-8), which without the
    # tolerance gave every member A = +0.056 (GRPO) and 6e-8 (Dr.GRPO, RLOO)
    rewards = torch.tensor([0.7] * 8 + [1.0, 0.0], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1, 1])
    assert float(rewards[:8].std()) > 0 and TIE_STD == 1e-6
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert grpo(rewards, groups).tolist() == [0.0] * 8 + [pytest.approx(a), pytest.approx(-a)]
    assert grpo(rewards, groups, norm_by_std=False).tolist() == [0.0] * 8 + [0.5, -0.5]
    assert rloo(rewards, groups).tolist() == [0.0] * 8 + [1.0, -1.0]
    # the tolerance scales with |mean| past 1: 100.7 (float32 ulp 7.6e-6) ties too; a real spread of 1e-3 does not
    assert grpo(torch.full((8,), 100.7), torch.zeros(8, dtype=torch.long)).tolist() == [0.0] * 8
    assert grpo(torch.tensor([0.7, 0.701]), torch.zeros(2, dtype=torch.long)).abs().min() > 0.7


def test_tied_pools_of_gigpo_and_reinforce_pp_baseline_are_exactly_zero():
    # GiGPO (mean_std_norm): group 0 is eight one-step episodes of reward 0.7 from anchor A (the
    # episode group and the step pool both tied in float32); group 1 (1, 0) is live at both levels:
    # +-0.5 / (sqrt(0.5) + 1e-6) each
    adv = gigpo(torch.tensor([0.7] * 8 + [1.0, 0.0]), torch.tensor([0] * 8 + [1, 1]),
                torch.tensor([0.7] * 8 + [1.0, 0.0]), torch.arange(10), ["A"] * 10, gamma=0.95)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == [0.0] * 8 + [pytest.approx(2 * a), pytest.approx(-2 * a)]
    # REINFORCE++-baseline: group 0 tied at 0.7 -> 0 before whitening; group 1 scores 1, 0 -> +-0.5,
    # whitened over 10 tokens (0 x 8, 0.5, -0.5): mean 0, unbiased var 0.5 / 9
    r = torch.tensor([[0.7]] * 8 + [[1.0], [0.0]])
    adv = reinforce_pp(r, torch.ones(10, 1), baseline_group_ids=torch.tensor([0] * 8 + [1, 1]))
    s = math.sqrt(0.5 / 9)
    assert adv.flatten().tolist() == [0.0] * 8 + [pytest.approx(0.5 / s, abs=1e-5), pytest.approx(-0.5 / s, abs=1e-5)]


def test_seq_mean_token_sum_and_a_constant_norm_len_across_minibatches():
    # minibatch 1: sequences of 1 and 3 tokens (losses 1 | 2, 3, 6); minibatch 2: 2 and 2 tokens
    # (1, 1 | 1, 1). seq-mean-token-sum: mean of the per-sequence sums.
    l1, s1 = torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([0, 1, 1, 1])
    l2, s2 = torch.ones(4), torch.tensor([2, 2, 3, 3])
    assert float(aggregate(l1, "seq-mean-token-sum", s1)) == pytest.approx((1 + 11) / 2)
    assert float(aggregate(l2, "seq-mean-token-sum", s2)) == pytest.approx((2 + 2) / 2)
    # seq-mean-token-sum-norm with the constant L = 8: 12 / (2 * 8) and 4 / (2 * 8), whatever the
    # minibatch's longest sequence (3 and 2: without the constant, 12 / 6 and 4 / 4)
    assert float(aggregate(l1, "seq-mean-token-sum-norm", s1, norm_len=8)) == pytest.approx(0.75)
    assert float(aggregate(l2, "seq-mean-token-sum-norm", s2, norm_len=8)) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        aggregate(l1, "token-sum", s1)
    # the entropy bonus reduces entropies with the loss's own aggregation
    assert float(entropy_bonus(l1, 0.1, "seq-mean-token-sum", s1)) == pytest.approx(-0.6)
