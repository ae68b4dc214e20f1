"""The RL trainer: reward shaping and per-algorithm credit by hand, gradient accumulation, dynamic
sampling, every algorithm end to end on real environments, and resume-after-kill equality."""

import pytest
import torch

from agentkiln.config import ALGORITHMS, ModelParams, RLParams
from agentkiln.envs import make
from agentkiln.policy import AgentFormat, build_prompt, build_scratch_policy
from agentkiln.rollout.agents import AgentState
from agentkiln.rollout.constrained import Generation
from agentkiln.rollout.engine import Episode, Turn
from agentkiln.synthesis.generate import generate
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.batch import Sample
from agentkiln.trainers.credit import shape_rewards, token_advantages

TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_context=256)


def turn(n_tokens, reward=0.0, anchor="s", invalid=False):
    gen = Generation(ids=list(range(n_tokens)), allowed=[], logprobs=[-1.0] * n_tokens)
    return Turn(state=AgentState("g", [], "o", []), gen=gen, anchor=anchor, reward=reward, invalid=invalid)


def episode(group, turns, won, max_turns=10):
    return Episode("t", "fam", group, task_type="tt", max_turns=max_turns, turns=turns, won=won)


def test_shaping_puts_penalties_on_the_right_tokens():
    p = RLParams(invalid_penalty=-0.1, truncation_penalty=-0.5, kl_coef=0.5)
    eps = [episode(0, [turn(2, invalid=True), turn(1, reward=1.0)], won=True),
           episode(0, [turn(1), turn(2, invalid=True)], won=False, max_turns=2)]  # ran out of turns
    assert shape_rewards(eps, p) == [[[0.0, -0.1], [1.0]], [[0.0], [0.0, -0.6]]]
    kl = [[[0.2, 0.4], [0.0]], [[1.0], [0.0, 0.2]]]
    flat = [x for ep in shape_rewards(eps, p, kl) for t in ep for x in t]
    assert flat == pytest.approx([-0.1, -0.3, 1.0, -0.5, 0.0, -0.7])


def test_episode_level_credit_is_broadcast_to_every_token():
    eps = [episode(0, [turn(2), turn(1, reward=1.0)], won=True), episode(0, [turn(3)], won=False),
           episode(1, [turn(1)], won=False)]  # a group of one: no signal
    rewards = shape_rewards(eps, RLParams())
    adv, ret = token_advantages("grpo", eps, rewards, RLParams())
    a = 1 / (2 ** 0.5 + 1e-6) / 1.0  # (1 - 0.5) / std([1, 0]) with std = sqrt(0.5)
    assert ret is None
    assert adv[0] == [[pytest.approx(a)] * 2, [pytest.approx(a)]] and adv[1] == [[pytest.approx(-a)] * 3]
    assert adv[2] == [[0.0]]
    adv, _ = token_advantages("dr_grpo", eps, rewards, RLParams())
    assert adv[0][0] == [0.5, 0.5] and adv[1][0] == [-0.5] * 3
    adv, _ = token_advantages("rloo", eps, rewards, RLParams())
    assert adv[0][1] == [1.0] and adv[1][0] == [-1.0] * 3


def test_gigpo_credit_differs_per_turn_by_anchor():
    # both episodes start in anchor s; the winner then visits w, the loser l: the step pool of s has
    # returns gamma * 1 and 0, the singleton pools of w and l give 0
    eps = [episode(0, [turn(1, anchor="s"), turn(1, reward=1.0, anchor="w")], won=True),
           episode(0, [turn(1, anchor="s"), turn(1, anchor="l")], won=False)]
    p = RLParams(gamma=0.5, step_weight=1.0)
    adv, _ = token_advantages("gigpo", eps, shape_rewards(eps, p), p)
    ep_a = 0.5 / (0.5 ** 0.5 + 1e-6)
    step_a = 0.25 / ((0.125 ** 0.5) + 1e-6)  # returns 0.5 and 0: mean 0.25, std sqrt(0.125)
    assert adv[0][0] == [pytest.approx(ep_a + step_a)] and adv[0][1] == [pytest.approx(ep_a)]
    assert adv[1][0] == [pytest.approx(-ep_a - step_a)] and adv[1][1] == [pytest.approx(-ep_a)]


def test_ppo_credit_uses_gae_over_turns_and_returns_targets():
    eps = [episode(0, [turn(1), turn(2, reward=1.0)], won=True), episode(0, [turn(1)], won=False)]
    p = RLParams(gamma=1.0, gae_lambda=1.0)
    values = [[0.5, 0.5], [0.25]]
    adv, ret = token_advantages("ppo", eps, shape_rewards(eps, p), p, values)
    assert ret == [[1.0, 1.0], [0.0]]  # returns: discounted rewards to go (the value after the end is 0)
    raw = torch.tensor([0.5, 0.5, -0.25])  # returns - values, whitened over the three turns
    white = ((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()
    assert adv[0] == [[pytest.approx(white[0])], [pytest.approx(white[1])] * 2] and adv[1] == [[pytest.approx(white[2])]]


def test_reinforce_pp_credit_is_per_token_and_whitened():
    eps = [episode(0, [turn(2), turn(1, reward=1.0)], won=True), episode(0, [turn(1)], won=False)]
    adv, _ = token_advantages("reinforce_pp", eps, shape_rewards(eps, RLParams()), RLParams())
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0])
    white = ((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()
    assert adv[0] == [[pytest.approx(white[0])] * 2, [pytest.approx(white[2])]] and adv[1] == [[pytest.approx(white[3])]]


ACTIONS = ["go east", "go west", "take coin"]


def tiny_policy(seed=0):
    corpus = [build_prompt(AgentFormat(), "find the coin", ["go east"], f"room {w}", ACTIONS) for w in "abc"]
    return build_scratch_policy(TINY, corpus, AgentFormat(history=1), seed=seed)


def samples_for(pol, n=12):
    from agentkiln.rollout.agents import PolicyAgent

    gens = PolicyAgent(pol, seed=1).act([AgentState("find the coin", [], f"room {'abc'[i % 3]}", ACTIONS) for i in range(n)])
    return [trainer.TurnSample(Sample(g.prompt_ids, g.ids, g.allowed), g.logprobs, [(-1.0) ** i * (1 + i / 10)] * len(g.ids))
            for i, g in enumerate(gens)]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_the_minibatch_gradient_exactly(agg):
    grads = []
    for micro in (None, 5):
        pol, ref = tiny_policy(), tiny_policy()
        p = RLParams(minibatch_size=12, micro_batch_size=micro, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, lr=0.1)
        opt = torch.optim.SGD(pol.model.parameters(), lr=0.0)  # a step that changes nothing: compare grads
        trainer.update(pol, ref, None, samples_for(pol), p, opt, None, torch.Generator().manual_seed(0))
        grads.append(torch.cat([q.grad.flatten() for q in pol.model.parameters() if q.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    return generate("gym-toytext", 6, seed=3, level="easy", out_dir=out, game="frozenlake"), out


def corpus_policy(tasks, tasks_dir, seed=0):
    texts = []
    for t in tasks:
        env = make(t, tasks_dir)
        obs = env.reset()
        texts.append(build_prompt(AgentFormat(), env.goal, [], obs.text, obs.admissible))
    return build_scratch_policy(TINY, texts, AgentFormat(history=1), seed=seed)


def test_dynamic_sampling_trains_only_on_groups_whose_rewards_vary(pool):
    tasks, tasks_dir = pool
    pol = corpus_policy(tasks, tasks_dir)
    import random

    p = RLParams(tasks_per_iter=3, group_size=4, dynamic_sampling=True, max_sample_rounds=3, max_turns=6)
    kept, everything, info = trainer.collect(pol, tasks, tasks_dir, p, random.Random(0), seed=0)
    assert info["episodes_played"] == len(everything) == 12 * info["sample_rounds"]
    by_group = {}
    for ep in kept:
        by_group.setdefault(ep.group, []).append(ep.reward)
    assert all(len(set(r)) > 1 for r in by_group.values()) and len(by_group) <= 3
    assert all(len(r) == 4 for r in by_group.values())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_and_reports_health(pool, algorithm):
    tasks, tasks_dir = pool
    pol, ref = corpus_policy(tasks, tasks_dir), corpus_policy(tasks, tasks_dir)
    before = [q.detach().clone() for q in pol.model.parameters()]
    p = RLParams(algorithm=algorithm, iterations=2, tasks_per_iter=3, group_size=4, max_turns=6, lr=1e-2,
                 truncation_penalty=-0.1)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    assert [h["iteration"] for h in hist] == [1, 2] and hist[-1]["episodes"] == 24
    keys = {"success", "entropy", "kl", "clip_frac", "grad_norm", "response_tokens", "zero_var_groups", "turns_mean",
            "invalid_rate", "truncated_rate", "success/easy"}
    trained = [h for h in hist if h["trained_turns"] > 0]  # an iteration of flat groups trains nothing
    assert trained and all(keys <= set(h) for h in trained), set(hist[-1])
    if algorithm == "ppo":
        assert "value_loss" in trained[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))


def test_episode_budget_stops_training(pool):
    tasks, tasks_dir = pool
    pol, ref = corpus_policy(tasks, tasks_dir), corpus_policy(tasks, tasks_dir)
    p = RLParams(iterations=5, tasks_per_iter=2, group_size=2, max_turns=4, episode_budget=6)
    assert len(trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)) == 2  # 4 + 4 >= 6 episodes


class Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm", ["gigpo", "ppo"])
def test_killed_run_resumes_from_its_checkpoint_with_identical_results(pool, tmp_path, algorithm):
    tasks, tasks_dir = pool
    p = RLParams(algorithm=algorithm, iterations=4, tasks_per_iter=2, group_size=3, max_turns=5, lr=5e-3,
                 dynamic_sampling=True)

    def run(log=None, ckpt=None):
        pol, ref = corpus_policy(tasks, tasks_dir), corpus_policy(tasks, tasks_dir)
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
    pol, ref = corpus_policy(tasks, tasks_dir), corpus_policy(tasks, tasks_dir)
    other = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=7, ckpt_dir=tmp_path / "ckpt", ckpt_key="other")
    assert other == straight


def test_free_generation_trains_with_an_invalid_action_penalty(pool):
    tasks, tasks_dir = pool
    pol, ref = corpus_policy(tasks, tasks_dir), corpus_policy(tasks, tasks_dir)
    p = RLParams(decoding="free", invalid_penalty=-0.5, iterations=1, tasks_per_iter=2, group_size=3, max_turns=3)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    # an untrained model's free text is never an admissible action: every turn invalid and penalised
    # alike, so every group is flat and nothing is trained (no signal, reported as such)
    assert hist[0]["invalid_rate"] == 1.0 and hist[0]["zero_var_groups"] == 1.0 and hist[0]["trained_turns"] == 0
