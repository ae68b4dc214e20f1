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
