"""Advantage estimators and policy losses by name: a new estimator is one decorated function, params
accept its name at once, and the trainer trains with it; unknown and clashing names are refused."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentkiln.algos import registry
from agentkiln.algos.registry import register_estimator, register_policy_loss
from agentkiln.config import ModelParams, ParamsError, RLParams, load_params
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.trainers import rl as trainer

from tests.conftest import task_texts

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)


def test_a_toy_estimator_registered_in_one_place_trains(lake_pool, monkeypatch):
    seen = []

    # the one place: this decorated function (the sign of the episode's reward against its group's mean)
    @register_estimator("toy_sign")
    def toy_sign(c, p):
        mean = torch.zeros(int(c.group.max()) + 1).index_add(0, c.group, c.episode_reward)
        mean = mean / torch.bincount(c.group).clamp(min=1)
        adv = torch.sign(c.episode_reward - mean[c.group])[c.turn_episode][c.token_turn]
        seen.append(adv)
        return adv, None

    assert "toy_sign" in registry.estimator_names()
    tasks, tasks_dir = lake_pool
    texts = task_texts(tasks, tasks_dir)
    pol = build_scratch_policy(TINY, texts, AgentFormat(), seed=0)
    ref = build_scratch_policy(TINY, texts, AgentFormat(), seed=0)
    trained = []
    real_update = trainer.update

    def spy(engine, policy, critic, batch, p, *args, **kw):
        trained.append(batch.advantages[batch.loss_mask].clone())
        return real_update(engine, policy, critic, batch, p, *args, **kw)

    monkeypatch.setattr(trainer, "update", spy)
    p = RLParams(algorithm="toy_sign", iterations=3, tasks_per_iter=3, group_size=4, max_turns=6, lr=1e-2, temperature=1.0,
                 reward={"truncation": {"weight": 0.1}}, minibatch_size=6, micro_batch_size=3)
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=0)
    assert [h["iteration"] for h in hist] == [1, 2, 3]
    # every update trained on exactly what the toy estimator returned that iteration, per reply token (the
    # trainer drops rows whose advantages are all 0, and a whole iteration of them trains nothing)
    want = [a[a != 0].float() for a in seen if (a != 0).any()]
    assert len(seen) == 3 and want and len(trained) == len(want)
    for got, w in zip(trained, want):
        assert torch.equal(got, w)


def test_unknown_names_are_refused_at_load_with_the_registered_ones():
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", ["rl.defaults.algorithm=nope", "rl.defaults.policy_loss=nope"])
    assert "rl.defaults.algorithm = 'nope': no registered advantage estimator; use one of grpo, dr_grpo, rloo" in str(e.value)
    assert "rl.defaults.policy_loss = 'nope': no registered policy loss; use one of ppo, gspo" in str(e.value)
    with pytest.raises(ValueError, match="rl.defaults.algorithm = 'nope' \\(stage main inherits it\\)|"
                                         "rl algorithm 'nope': expected one of grpo"):
        registry.estimator("nope")  # the trainer's lookup names the registered ones too


def test_importing_config_imports_no_estimator_code():
    code = "import sys, agentkiln.config; print('agentkiln.algos.estimators' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_taken_name_is_refused_and_a_registered_loss_is_used_by_name():
    with pytest.raises(ValueError, match="'gigpo' is registered already"):
        register_estimator("gigpo")(lambda c, p: (None, None))

    @register_policy_loss("toy_reinforce", token_level=True)
    def toy_reinforce(logp, old_logp, adv, seq_ids, p):
        return -(logp * adv).mean(), {"clip_frac": 0.0, "ratio_mean": 1.0}

    p = RLParams(policy_loss="toy_reinforce")
    logp, adv = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, -1.0])
    loss, _ = registry.policy_loss(p.policy_loss).fn(logp, logp, adv, torch.tensor([0, 0]), p)
    assert float(loss) == pytest.approx(-0.5)  # -(-1 * 1 + -2 * -1) / 2
    assert registry.estimator("ppo").needs_critic and not registry.estimator("gigpo").needs_critic
