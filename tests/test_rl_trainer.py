"""The RL trainer: reward shaping and per-algorithm credit by hand on the flat batch, gradient
accumulation, dynamic sampling, every algorithm end to end on real environments, and
resume-after-kill equality."""

import math
import random

import pytest
import torch

from agentkiln.algos.registry import estimator_names
from agentkiln.config import ModelParams, RLParams
from agentkiln.policy import AgentFormat, Policy, build_scratch_policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.sequence import add_reply
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.batch import Batch, build_batch
from agentkiln.trainers.credit import advantages, shaped_turn_rewards, turn_rewards
from agentkiln.trainers.engine import LocalEngine

from tests.conftest import task_texts

TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)


def episode(group, turns, won, max_turns=10) -> Episode:
    """An episode with token ids: turns are (reply tokens, reward, anchor, invalid); each reply is
    followed by a one-token observation."""
    ep = Episode("t", "fam", group, "tt", max_turns, "g", ids=[1, 2], prompt_len=2, windows=[[0, 2]])
    for k, (n, r, anchor, invalid) in enumerate(turns):
        if k:
            ep.ids.append(9)
        ep.turns.append(Turn("o", [], anchor, reward=r, invalid=invalid))
        add_reply(ep, list(range(3, 3 + n)), [-1.0] * n)
    ep.won = won
    return ep


def t(n, reward=0.0, anchor="s", invalid=False):
    return (n, reward, anchor, invalid)


def per_turn(batch: Batch, column: torch.Tensor, eps) -> list[list[list[float]]]:
    """A [R, T] column read back per episode, turn and token."""
    out = [[[] for _ in ep.turns] for ep in eps]
    for (r, c), i in zip(batch.loss_mask.nonzero().tolist(), batch.flat(batch.turn_index).tolist()):
        e, k = batch.turns[i]
        out[e][k].append(float(column[r, c]))
    return out


def test_shaping_puts_penalties_on_the_right_turns_and_kl_on_every_token():
    p = RLParams(reward={"invalid": {"weight": 0.1}, "truncation": {"weight": 0.5}, "bound": 1.0}, kl_coef=0.5)
    eps = [episode(0, [t(2, invalid=True), t(1, reward=1.0)], won=True),
           episode(0, [t(1), t(2, invalid=True)], won=False, max_turns=2)]  # ran out of turns
    assert shaped_turn_rewards(eps, p) == [[-0.1, 1.0], [0.0, -0.6]]
    batch = build_batch(eps, 0)
    kl = torch.tensor([0.2, 0.4, 0.0, 1.0, 0.0, 0.2])  # per reply token, in order
    ep_of, r = turn_rewards(batch, eps, p, kl)
    assert ep_of.tolist() == [0, 0, 1, 1]
    assert r.tolist() == pytest.approx([-0.1 - 0.3, 1.0, -0.5, -0.6 - 0.1])


def test_episode_level_credit_is_broadcast_to_every_reply_token():
    eps = [episode(0, [t(2), t(1, reward=1.0)], won=True), episode(0, [t(3)], won=False),
           episode(1, [t(1)], won=False)]  # a group of one: no signal
    batch = build_batch(eps, 0)
    adv, ret = advantages(batch, eps, RLParams(algorithm="grpo"))
    a = 1 / (2 ** 0.5 + 1e-6)  # (1 - 0.5) / std([1, 0]) with std = sqrt(0.5)
    got = per_turn(batch, adv, eps)
    assert ret is None
    assert got[0] == [[pytest.approx(a)] * 2, [pytest.approx(a)]] and got[1] == [[pytest.approx(-a)] * 3]
    assert got[2] == [[0.0]]
    assert adv[~batch.loss_mask].abs().max() == 0  # prompt and observation positions carry nothing
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="dr_grpo"))[0], eps)
    assert got[0][0] == [0.5, 0.5] and got[1][0] == [-0.5] * 3
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="rloo"))[0], eps)
    assert got[0][1] == [1.0] and got[1][0] == [-1.0] * 3


def test_gigpo_credit_differs_per_turn_by_anchor():
    # both episodes start in anchor s; the winner then visits w, the loser l: the step pool of s has
    # returns gamma * 1 and 0, the singleton pools of w and l give 0
    eps = [episode(0, [t(1, anchor="s"), t(1, reward=1.0, anchor="w")], won=True),
           episode(0, [t(1, anchor="s"), t(1, anchor="l")], won=False)]
    p = RLParams(algorithm="gigpo", gamma=0.5, step_weight=1.0)
    batch = build_batch(eps, 0)
    got = per_turn(batch, advantages(batch, eps, p)[0], eps)
    ep_a = 0.5 / (0.5 ** 0.5 + 1e-6)
    step_a = 0.25 / ((0.125 ** 0.5) + 1e-6)  # returns 0.5 and 0: mean 0.25, std sqrt(0.125)
    assert got[0] == [[pytest.approx(ep_a + step_a)], [pytest.approx(ep_a)]]
    assert got[1] == [[pytest.approx(-ep_a - step_a)], [pytest.approx(-ep_a)]]


def test_ppo_credit_uses_gae_over_turns_and_returns_targets():
    eps = [episode(0, [t(1), t(2, reward=1.0)], won=True), episode(0, [t(1)], won=False)]
    p = RLParams(algorithm="ppo", gamma=1.0, gae_lambda=1.0)
    batch = build_batch(eps, 0)
    adv, ret = advantages(batch, eps, p, values=torch.tensor([0.5, 0.5, 0.25]))
    assert ret.tolist() == [1.0, 1.0, 0.0]  # returns: rewards to go (the value after the end is 0)
    raw = torch.tensor([0.5, 0.5, -0.25])  # returns - values, whitened over the three turns
    white = ((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()
    got = per_turn(batch, adv, eps)
    assert got[0] == [[pytest.approx(white[0])], [pytest.approx(white[1])] * 2] and got[1] == [[pytest.approx(white[2])]]


def test_reinforce_pp_credit_is_per_token_and_whitened():
    eps = [episode(0, [t(2), t(1, reward=1.0)], won=True), episode(0, [t(1)], won=False)]
    batch = build_batch(eps, 0)
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="reinforce_pp"))[0], eps)
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0])
    white = ((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()
    assert got[0] == [[pytest.approx(white[0])] * 2, [pytest.approx(white[2])]] and got[1] == [[pytest.approx(white[3])]]


def test_gigpo_mean_norm_mode_centres_without_std_division():
    # the episodes of test_gigpo_credit_differs_per_turn_by_anchor under verl-agent's mean_norm:
    # episode level 1 - 0.5 = +-0.5; pool s: returns 0.5 and 0 -> +-0.25; singleton pools 0
    eps = [episode(0, [t(1, anchor="s"), t(1, reward=1.0, anchor="w")], won=True),
           episode(0, [t(1, anchor="s"), t(1, anchor="l")], won=False)]
    p = RLParams(algorithm="gigpo", gamma=0.5, gigpo_mode="mean_norm")
    batch = build_batch(eps, 0)
    assert per_turn(batch, advantages(batch, eps, p)[0], eps) == [[[0.75], [0.5]], [[-0.75], [-0.5]]]


def test_per_family_advantage_normalisation_gives_each_family_unit_rms():
    """adv_norm family: GRPO advantages of a 2-token family (+-0.7071 on 4 tokens: RMS 0.7071) and a
    3-token family in another group (+1.1547 x 3 tokens, -0.5774 x 3 x 2 episodes) each divided by
    their own RMS over tokens; signs kept, a family of zeros untouched."""
    eps = [episode(0, [t(2, reward=1.0)], won=True), episode(0, [t(2)], won=False),
           episode(1, [t(3, reward=1.0)], won=True), episode(1, [t(3)], won=False), episode(1, [t(3)], won=False),
           episode(2, [t(1)], won=False), episode(2, [t(1)], won=False)]
    for e, fam in zip(eps, ["lake", "lake", "words", "words", "words", "shop", "shop"]):
        e.family = fam
    batch = build_batch(eps, 0)
    approx = lambda v: pytest.approx(v, rel=1e-5)  # noqa: E731  (GRPO divides by std + 1e-6)
    plain = per_turn(batch, advantages(batch, eps, RLParams(algorithm="grpo"))[0], eps)
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="grpo", adv_norm="family"))[0], eps)
    a, b = 1 / math.sqrt(2), 2 / math.sqrt(3)  # GRPO with the unbiased std: groups of 2 and 3
    assert plain[0][0][0] == approx(a) and plain[2][0][0] == approx(b)
    rms_lake = a  # every lake token is +-a
    rms_words = math.sqrt((3 * b ** 2 + 6 * (b / 2) ** 2) / 9)
    assert got[0] == [[approx(a / rms_lake)] * 2] and got[1] == [[approx(-a / rms_lake)] * 2]
    assert got[2] == [[approx(b / rms_words)] * 3] and got[3] == [[approx(-b / 2 / rms_words)] * 3]
    assert got[5] == [[0.0]] and got[6] == [[0.0]]  # a tied group: nothing to scale
    for fam in ("lake", "words"):  # unit RMS over each family's tokens
        vals = [x for e, ep in enumerate(eps) if ep.family == fam for turn in got[e] for x in turn]
        assert math.sqrt(sum(x * x for x in vals) / len(vals)) == approx(1.0)


def test_positive_weight_scales_only_the_positive_advantages():
    """W-REINFORCE: GRPO's +-0.7071 in a won/lost pair and +1.1547 / -0.5774 in a group of three; with
    positive_weight 0.1 the positive ones are a tenth, the negative ones unchanged, a tied group 0."""
    eps = [episode(0, [t(2, reward=1.0)], won=True), episode(0, [t(2)], won=False),
           episode(1, [t(1, reward=1.0)], won=True), episode(1, [t(1)], won=False), episode(1, [t(1)], won=False),
           episode(2, [t(1)], won=False), episode(2, [t(1)], won=False)]
    batch = build_batch(eps, 0)
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="grpo", positive_weight=0.1))[0], eps)
    a, b = 1 / math.sqrt(2), 2 / math.sqrt(3)  # GRPO with the unbiased std: groups of 2 and 3
    approx = lambda v: pytest.approx(v, rel=1e-5)  # noqa: E731  (GRPO divides by std + 1e-6)
    assert got[0] == [[approx(0.1 * a)] * 2] and got[1] == [[approx(-a)] * 2]
    assert got[2] == [[approx(0.1 * b)]] and got[3] == got[4] == [[approx(-b / 2)]]
    assert got[5] == got[6] == [[0.0]]
    plain = per_turn(batch, advantages(batch, eps, RLParams(algorithm="grpo", positive_weight=1.0))[0], eps)
    assert plain[0] == [[approx(a)] * 2]  # 1: as the estimator computed


def test_reinforce_pp_baseline_credit_subtracts_the_group_mean_then_whitens():
    # scores 1 and 0 (group mean 0.5) -> +0.5 on the winner's 3 tokens, -0.5 on the loser's one;
    # whitened over the 4 tokens: mean 0.25, unbiased var 0.25 -> 0.5, 0.5, 0.5, -1.5
    eps = [episode(0, [t(2), t(1, reward=1.0)], won=True), episode(0, [t(1)], won=False)]
    batch = build_batch(eps, 0)
    got = per_turn(batch, advantages(batch, eps, RLParams(algorithm="reinforce_pp_baseline"))[0], eps)
    assert got == [[[pytest.approx(0.5)] * 2, [pytest.approx(0.5)]], [[pytest.approx(-1.5)]]]


def test_credit_spans_an_episodes_windows():
    # an episode in two windows (rows): per-episode credit must see both, in order
    ep = episode(0, [t(1), t(1), t(1, reward=1.0)], won=True)
    ep.windows = [[0, ep.turns[1].end], [ep.turns[1].start, len(ep.ids)]]  # window 1: c_0 + turns 1-2
    ep.turns[2].window = 1
    lost = episode(0, [t(1)], won=False)
    batch = build_batch([ep, lost], 0)
    assert batch.rows == 3 and batch.episode.tolist() == [0, 0, 1]
    got = per_turn(batch, advantages(batch, [ep, lost], RLParams(algorithm="reinforce_pp"))[0], [ep, lost])
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0])  # return to go of each of the winner's tokens, then the loser's
    white = ((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()
    assert [x for turn in got[0] for x in turn] == pytest.approx(white[:3]) and got[1] == [[pytest.approx(white[3])]]


# ---------------------------------------------------------------- the update's loss by value
def fixed_scores(monkeypatch, entropy: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replace the model's scoring in the trainer: every reply token's log-prob is its behaviour
    log-prob (ratio 1) and its entropy is `entropy[its position]` (`fixed_batch` numbers the reply
    tokens by their ids), both leaves whose gradients the test reads. Returns (micro-batch, logp,
    entropy) of every micro-batch."""
    seen = []

    def fake(model, batch, temperature=1.0, with_entropy=True):
        logp = batch.flat(batch.old_logp).clone().requires_grad_()
        pos = batch.flat(batch.input_ids) - TOKEN0
        ent = (entropy[pos] if entropy is not None else torch.zeros(len(pos))).clone().requires_grad_()
        seen.append((batch, logp, ent))
        return logp, ent

    monkeypatch.setattr(trainer, "token_logprobs", fake)
    return seen


def fixed_batch(lengths: list[int], adv: list[float]) -> Batch:
    """One single-turn episode per entry (group 0), its reply tokens' advantage set to adv[e]; the
    reply tokens' ids are TOKEN0 + their position in the batch (no model reads them)."""
    eps = [episode(0, [t(n)], won=False) for n in lengths]
    batch = build_batch(eps, 0)
    batch.advantages = torch.tensor(adv)[batch.episode][:, None] * batch.loss_mask
    batch.input_ids[batch.loss_mask] = TOKEN0 + torch.arange(batch.n_tokens)
    return batch


def grads_by_token(seen, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accumulated d loss / d logp and d loss / d entropy of each of the batch's n tokens."""
    g_logp, g_ent = torch.zeros(n), torch.zeros(n)
    for batch, logp, ent in seen:
        pos = batch.flat(batch.input_ids) - TOKEN0
        g_logp.index_add_(0, pos, logp.grad)
        if ent.grad is not None:  # None: the loss had no entropy term
            g_ent.index_add_(0, pos, ent.grad)
    return g_logp, g_ent


def local(pol: Policy, opt: torch.optim.Optimizer, p: RLParams) -> LocalEngine:
    return LocalEngine(pol.model, opt, p.max_grad_norm, pol.trainable())


FAKE_POLICY = Policy(torch.nn.Linear(1, 1), tokenizer=None)  # scoring is faked: only update's optimizer sees it
TOKEN0 = 1000


@pytest.mark.parametrize("micro", [None, 1])
def test_seq_mean_token_sum_norm_divides_by_the_configured_constant_in_every_minibatch(monkeypatch, micro):
    # episodes of 3, 1, 2, 2 reply tokens with advantages 1, -1, 2, 0.5, two episodes per minibatch
    # (shuffled: the longest episode of a minibatch is 3 or 2). Ratio 1: token loss -A, so with
    # L = loss_agg_norm_len = 10 every token's gradient is -A / (2 episodes * 10) whichever minibatch
    # it falls in, and the mean minibatch loss is (-3 + 1 - 4 - 1) / (2 minibatches * 2 * 10).
    seen = fixed_scores(monkeypatch)
    batch = fixed_batch([3, 1, 2, 2], [1.0, -1.0, 2.0, 0.5])
    p = RLParams(loss_agg="seq-mean-token-sum-norm", loss_agg_norm_len=10, minibatch_size=2,
                 micro_batch_size=micro, kl_coef=0.0)
    opt = torch.optim.SGD(FAKE_POLICY.model.parameters(), lr=0.0)
    stats = trainer.update(local(FAKE_POLICY, opt, p), FAKE_POLICY, None, batch, p, None, torch.Generator().manual_seed(0))
    g_logp, _ = grads_by_token(seen, 8)
    adv = [1.0] * 3 + [-1.0] + [2.0] * 2 + [0.5] * 2
    assert g_logp.tolist() == pytest.approx([-a / 20 for a in adv], abs=1e-7)
    # the stats are the minibatches' own values, micro-batched or not
    assert stats["pg_loss"] == pytest.approx(-7 / 40, abs=1e-7)


def test_update_loss_is_policy_loss_plus_kl_minus_entropy_bonus_by_value(monkeypatch):
    # 8 reply tokens (episodes of 3, 1, 2, 2 tokens, advantages 1, -1, 2, 0.5), entropies 1..8, the
    # reference 1 nat below the behaviour policy on every token, token-mean, one minibatch:
    #   policy loss  -(3 - 1 + 4 + 1) / 8 = -0.875;  k3 per token: e^-1 + 1 - 1 = 0.367879
    #   entropy      mean 4.5;  loss = -0.875 + 0.5 * 0.367879 - 0.1 * 4.5
    entropy = torch.arange(1.0, 9.0)
    seen = fixed_scores(monkeypatch, entropy)
    batch = fixed_batch([3, 1, 2, 2], [1.0, -1.0, 2.0, 0.5])
    batch.ref_logp = batch.old_logp - 1.0
    p = RLParams(minibatch_size=4, kl_coef=0.5, kl_estimator="k3", entropy_coef=0.1)
    opt = torch.optim.SGD(FAKE_POLICY.model.parameters(), lr=0.0)
    stats = trainer.update(local(FAKE_POLICY, opt, p), FAKE_POLICY, None, batch, p, None, torch.Generator().manual_seed(0))
    k3 = math.exp(-1)
    assert stats["pg_loss"] == pytest.approx(-0.875)
    assert stats["kl"] == pytest.approx(k3, abs=1e-6)
    assert stats["entropy"] == pytest.approx(4.5)
    assert stats["loss"] == pytest.approx(-0.875 + 0.5 * k3 - 0.45, abs=1e-6)
    g_logp, g_ent = grads_by_token(seen, 8)
    assert g_ent.tolist() == pytest.approx([-0.1 / 8] * 8)  # d(-0.1 * mean H) / d H_t
    # d/d logp: -A / 8 from the policy loss, + 0.5 * (1 - e^(ref - logp)) / 8 from k3
    adv = [1.0] * 3 + [-1.0] + [2.0] * 2 + [0.5] * 2
    assert g_logp.tolist() == pytest.approx([(-a + 0.5 * (1 - k3)) / 8 for a in adv], abs=1e-6)
    # entropy_coef 0: no entropy term in the loss (still reported)
    seen.clear()
    stats = trainer.update(local(FAKE_POLICY, opt, p), FAKE_POLICY, None, batch,
                           p.model_copy(update={"entropy_coef": 0.0}), None, torch.Generator().manual_seed(0))
    assert stats["loss"] == pytest.approx(-0.875 + 0.5 * k3, abs=1e-6) and stats["entropy"] == pytest.approx(4.5)
    assert grads_by_token(seen, 8)[1].abs().max() == 0


@pytest.fixture(scope="module")
def texts(lake_pool):
    return task_texts(*lake_pool)


def policy(texts, seed=0):
    return build_scratch_policy(TINY, texts, AgentFormat(), seed=seed)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_the_minibatch_gradient_exactly(lake_pool, texts, agg):
    tasks, tasks_dir = lake_pool
    grads = []
    for micro in (None, 5):
        pol, ref = policy(texts), policy(texts, seed=1)
        eps = run_episodes(PolicyAgent(pol, seed=1), tasks, tasks_dir, 4, group_size=2)
        p = RLParams(minibatch_size=12, micro_batch_size=micro, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01)
        batch = build_batch(eps, pol.pad_id)
        batch.ref_logp = trainer.score(ref, batch, 1.0, 4)
        batch.advantages = torch.linspace(-1, 1, batch.rows)[:, None] * batch.loss_mask
        opt = torch.optim.SGD(pol.model.parameters(), lr=0.0)  # a step that changes nothing: compare grads
        trainer.update(local(pol, opt, p), pol, None, batch, p, None, torch.Generator().manual_seed(0))
        grads.append(torch.cat([q.grad.flatten() for q in pol.model.parameters() if q.grad is not None]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


def test_dynamic_sampling_trains_only_on_groups_whose_rewards_vary(lake_pool, texts):
    tasks, tasks_dir = lake_pool
    pol = policy(texts)
    p = RLParams(tasks_per_iter=3, group_size=4, dynamic_sampling=True, max_sample_rounds=3, max_turns=6)
    kept, everything, info = trainer.collect(pol, tasks, tasks_dir, p, random.Random(0), seed=0)
    assert info["episodes_played"] == len(everything) == 12 * info["sample_rounds"]
    by_group = {}
    for ep in kept:
        by_group.setdefault(ep.group, []).append(ep.reward)
    assert all(len(set(r)) > 1 for r in by_group.values()) and len(by_group) <= 3
    assert all(len(r) == 4 for r in by_group.values())


@pytest.mark.parametrize("algorithm", estimator_names())
def test_every_algorithm_trains_and_reports_health(lake_pool, texts, algorithm, monkeypatch):
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts)
    moved = []  # per update: sum over its batch's tokens of A * (log-prob after - before)
    real_update = trainer.update

    def spy(engine, policy, critic, batch, p, *args, **kw):
        before = trainer.score(policy, batch, p.temperature, 64)
        out = real_update(engine, policy, critic, batch, p, *args, **kw)
        after = trainer.score(policy, batch, p.temperature, 64)
        moved.append(float((batch.advantages * (after - before)).sum()))
        return out

    monkeypatch.setattr(trainer, "update", spy)
    p = RLParams(algorithm=algorithm, iterations=2, tasks_per_iter=3, group_size=4, max_turns=6, lr=1e-2,
                 reward={"truncation": {"weight": 0.1}}, minibatch_size=6, micro_batch_size=3)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    assert [h["iteration"] for h in hist] == [1, 2] and hist[-1]["episodes"] == 24
    keys = {"success", "entropy", "kl", "clip_frac", "grad_norm", "response_tokens", "episode_tokens",
            "zero_var_groups", "turns_mean", "invalid_rate", "truncated_rate", "success/easy"}
    trained = [h for h in hist if h["trained_tokens"] > 0]  # an iteration of flat groups trains nothing
    assert trained and all(keys <= set(h) for h in trained), set(hist[-1])
    if algorithm == "ppo":
        assert "value_loss" in trained[0]
    # the first update (fresh optimizer) moved the policy up its advantages: sum_t A_t * (log-prob
    # after - before) over its batch is > 0, so positive-advantage tokens gained on negative ones (a
    # sign error, a zeroed loss or a lost step fails). Later updates mix Adam's momentum from other
    # batches into the step and need not climb their own batch's surrogate.
    assert len(moved) == len(trained) and moved[0] > 0, moved


def test_guidance_trains_the_experts_turns_and_counts_only_the_policys_own_success(lake_pool, texts, monkeypatch):
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts)
    p = RLParams(algorithm="gigpo", iterations=2, tasks_per_iter=3, group_size=4, max_turns=12, lr=1e-2,
                 minibatch_size=12, guidance={"per_group": 2})
    seen = []  # per iteration: (every episode played, the batch trained)
    real_collect, real_update = trainer.collect, trainer.update

    def spy_collect(*args, **kw):
        out = real_collect(*args, **kw)
        seen.append([out[1]])
        return out

    def spy_update(engine, policy, critic, batch, *args, **kw):
        seen[-1].append(batch)
        return real_update(engine, policy, critic, batch, *args, **kw)

    monkeypatch.setattr(trainer, "collect", spy_collect)
    monkeypatch.setattr(trainer, "update", spy_update)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    for h, (played, *batch) in zip(hist, seen):
        own = [ep for ep in played if ep.guide_at is None]
        guided = [ep for ep in played if ep.guide_at is not None]
        assert len(own) == len(guided) == 6  # two of every group of four
        assert h["success"] == sum(ep.won for ep in own) / 6
        assert h["guided/success"] == sum(ep.won for ep in guided) / 6
        turns = [t for ep in played for t in ep.turns]
        assert h["guided/turn_share"] == sum(t.guided for t in turns) / len(turns) > 0
    # a random-init policy rarely wins a lake; the expert's continuations do, so their groups vary
    # and the expert's turns reach the update with a positive advantage
    expert_adv = [t.advantage for played, *_ in seen for ep in played for t in ep.turns
                  if t.guided and t.advantage is not None]
    assert expert_adv and max(expert_adv) > 0


def test_episode_budget_stops_training(lake_pool, texts):
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts)
    p = RLParams(iterations=5, tasks_per_iter=2, group_size=2, max_turns=4, episode_budget=6)
    assert len(trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)) == 2  # 4 + 4 >= 6 episodes


class Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm", ["gigpo", "ppo"])
def test_killed_run_resumes_from_its_checkpoint_with_identical_results(lake_pool, texts, tmp_path, algorithm):
    tasks, tasks_dir = lake_pool
    p = RLParams(algorithm=algorithm, iterations=4, tasks_per_iter=2, group_size=3, max_turns=5, lr=5e-3,
                 dynamic_sampling=True, minibatch_size=3)

    def run(log=None, ckpt=None):
        pol, ref = policy(texts), policy(texts)
        hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=7, log=log, ckpt_dir=ckpt, ckpt_key="k")
        return hist, pol

    straight, pol_a = run()

    def kill_at_3(row, step):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        run(log=kill_at_3, ckpt=tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "state.pt").is_file()
    resumed_rows = []
    resumed, pol_b = run(log=lambda row, step: resumed_rows.append(step), ckpt=tmp_path / "ckpt")
    assert resumed_rows == [1, 2, 3, 4]  # restored rows re-logged, then iterations 3 and 4 trained
    assert resumed == straight
    for a, b in zip(pol_a.model.parameters(), pol_b.model.parameters()):
        assert torch.equal(a, b)
    # a checkpoint of another run (another key) is ignored
    pol, ref = policy(texts), policy(texts)
    other = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=7, ckpt_dir=tmp_path / "ckpt", ckpt_key="other")
    assert other == straight


def test_free_generation_trains_with_an_invalid_action_penalty(lake_pool, texts):
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts)
    p = RLParams(decoding={"gym-toytext": "free"}, max_reply_tokens=4, reward={"invalid": {"weight": 0.5}}, iterations=1,
                 tasks_per_iter=2, group_size=3, max_turns=3)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    # an untrained model's free text is never an admissible action: every turn invalid and penalised
    # alike, so every group is flat and nothing is trained (no signal, reported as such)
    assert hist[0]["invalid_rate"] == 1.0 and hist[0]["zero_var_groups"] == 1.0 and hist[0]["trained_tokens"] == 0
    assert hist[0]["response_tokens"] == 4  # replies ran to the budget


def test_rollout_mismatch_and_truncated_importance_weights_by_hand():
    # 4 reply tokens; the rollout engine's log-probs vs the trainer's recomputation differ by
    # +0.5, -0.2, 0, +2 nats: pi_trainer / pi_rollout = e^0.5, e^-0.2, 1, e^2, capped at 2 by TIS
    batch = fixed_batch([3, 1], [1.0, -1.0])
    batch.old_logp[batch.loss_mask] = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    trainer_logp = batch.old_logp.clone()
    trainer_logp[batch.loss_mask] += torch.tensor([0.5, -0.2, 0.0, 2.0])
    weight, stats = trainer.rollout_mismatch(batch, trainer_logp, tis_cap=2.0)
    assert weight.tolist() == pytest.approx([math.exp(0.5), math.exp(-0.2), 1.0, 2.0], abs=1e-6)
    assert stats["mismatch/abs_logp_diff"] == pytest.approx((0.5 + 0.2 + 0 + 2) / 4, abs=1e-6)
    assert stats["mismatch/max_abs_logp_diff"] == pytest.approx(2.0, abs=1e-6)
    k3 = [math.exp(d) - 1 - d for d in (0.5, -0.2, 0.0, 2.0)]
    assert stats["mismatch/k3_kl"] == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert stats["mismatch/tis_clipped_frac"] == pytest.approx(0.25)
    assert stats["mismatch/tis_weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.2) + 1 + 2) / 4, abs=1e-6)
    off, stats = trainer.rollout_mismatch(batch, trainer_logp, tis_cap=None)  # TIS off: weights 1, still measured
    assert off.tolist() == [1.0] * 4 and "mismatch/tis_weight_mean" not in stats


def test_the_scoring_passes_cover_only_the_rows_trained(lake_pool, texts):
    # 3 groups of 4; only group 1's returns vary (one episode wins): its 4 rows are the batch, and the
    # recomputation (rollout from elsewhere) and the KL reference score those rows alone; turns of the
    # dropped rows keep advantage 0 and no trainer log-prob
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts, seed=1)
    p = RLParams(tasks_per_iter=3, group_size=4, max_turns=4, kl_coef=0.1, tis_cap=2.0)
    eps, _, _ = trainer.collect(pol, tasks, tasks_dir, p, random.Random(0), seed=0)
    for ep in eps:
        for turn in ep.turns:
            turn.reward = 0.0
    winner = next(ep for ep in eps if ep.group == 1)
    winner.turns[-1].reward = 1.0
    scored: dict[str, int] = {"policy": 0, "ref": 0}
    for name, pl in (("policy", pol), ("ref", ref)):
        pl.model.get_input_embeddings().register_forward_hook(
            lambda mod, args, out, name=name: scored.__setitem__(name, scored[name] + args[0].shape[0]))
    full = build_batch(eps, pol.pad_id)
    batch, _, _, stats = trainer.prepare(pol, ref, None, eps, p, recompute=True)
    trained = [e for e, ep in enumerate(eps) if ep.group == 1]
    assert full.rows == 12 and batch.rows == 4 and sorted(batch.episode.tolist()) == trained
    assert scored == {"policy": 4, "ref": 4}
    assert stats["mismatch/abs_logp_diff"] < 1e-5  # the same weights sampled them
    for e, ep in enumerate(eps):
        for turn in ep.turns:
            if e in trained:
                assert turn.trainer_logp is not None and turn.advantage != 0.0
            else:
                assert turn.trainer_logp is None and turn.advantage == 0.0


def test_prepare_recomputes_old_logprobs_and_weights_advantages_when_the_rollout_came_from_elsewhere(lake_pool, texts):
    # episodes as if another engine had sampled them 0.3 nats likelier than the trainer scores them:
    # old log-probs become the trainer's, the mismatch is measured, and TIS scales every advantage by
    # e^-0.3 (under the cap) against the same batch prepared without recomputation
    tasks, tasks_dir = lake_pool
    pol = policy(texts)
    p = RLParams(tasks_per_iter=3, group_size=4, max_turns=6, reward={"truncation": {"weight": 0.1}}, kl_coef=0.0,
                 tis_cap=2.0)
    eps, _, _ = trainer.collect(pol, tasks, tasks_dir, p, random.Random(0), seed=0)
    plain, _, _, none = trainer.prepare(pol, None, None, eps, p)
    assert none == {}
    for ep in eps:
        for turn in ep.turns:
            turn.logprobs = [lp + 0.3 for lp in turn.logprobs]
    batch, _, _, stats = trainer.prepare(pol, None, None, eps, p, recompute=True)
    assert stats["mismatch/abs_logp_diff"] == pytest.approx(0.3, abs=1e-4)
    assert stats["mismatch/tis_weight_mean"] == pytest.approx(math.exp(-0.3), abs=1e-4)
    assert torch.allclose(batch.flat(batch.old_logp), plain.flat(plain.old_logp), atol=1e-5)
    assert torch.allclose(batch.flat(batch.advantages), plain.flat(plain.advantages) * math.exp(-0.3), atol=1e-5)
