"""Asynchronous RL (trainers.inflight.InFlight): the next iteration's rollouts play on a snapshot of the
weights while this one trains; every consumed batch within the staleness bound, deterministic, resumable
exactly; the off-policy corrections by hand."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from agentkiln.config import ModelParams, RLParams
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.trainers import rl as trainer

from tests.conftest import ROOT, task_texts
from tests.processes import alive, descendants
from tests.test_rl_trainer import fixed_batch

TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)


@pytest.fixture(scope="module")
def texts(lake_pool):
    return task_texts(*lake_pool)


def policy(texts):
    return build_scratch_policy(TINY, texts, AgentFormat(), seed=0)


def params(staleness: int, **kw) -> RLParams:
    return RLParams(iterations=4, tasks_per_iter=2, group_size=4, max_turns=5, lr=2e-2, temperature=1.0,
                    reward={"truncation": {"weight": 0.1}}, minibatch_size=4,
                    asynchronous={"max_staleness": staleness}, **kw)


def run(texts, lake_pool, p, **kw):
    tasks, tasks_dir = lake_pool
    pol, ref = policy(texts), policy(texts)
    return trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=3, **kw), pol


def recomputed(p: RLParams) -> RLParams:
    """`p` with the proximal policy's log-probs recomputed by a forward pass before the update."""
    return p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update={"proximal": "recompute"})})


def test_staleness_one_plays_each_batch_one_version_behind_within_the_bound_deterministically(lake_pool, texts):
    hist, pol = run(texts, lake_pool, recomputed(params(1)))
    assert [h["async/staleness"] for h in hist] == [0, 1, 1, 1]  # the first iteration has nothing in flight
    # the trainer recomputed every batch under its own weights: the first is the same weights (float
    # noise of a batched vs an incremental forward), later ones one update behind, so they differ
    assert hist[0]["mismatch/abs_logp_diff"] < 1e-4
    assert all(h["mismatch/abs_logp_diff"] > 1e-3 for h in hist[1:] if h["trained_tokens"]), hist
    assert all("mismatch/k3_kl" in h and "mismatch/tis_weight_mean" in h for h in hist)
    # (the same bytes whoever plays and whenever: test_whoever_plays_a_chunk_the_run_is_the_same_bytes)
    sync, _ = run(texts, lake_pool, params(0))
    assert [h["async/staleness"] for h in sync] == [0, 0, 0, 0] and "mismatch/k3_kl" not in sync[0]


class Killed(Exception):
    pass


def test_masked_and_truncated_importance_weights_by_hand():
    # behaviour vs trainer log-probs differ by +0.5, -0.2, 0, +2 nats: ratios e^0.5 = 1.65, e^-0.2 = 0.82, 1, e^2 = 7.4
    batch = fixed_batch([3, 1], [1.0, -1.0])
    batch.old_logp[batch.loss_mask] = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    trainer_logp = batch.old_logp.clone()
    trainer_logp[batch.loss_mask] += torch.tensor([0.5, -0.2, 0.0, 2.0])
    masked, stats = trainer.rollout_mismatch(batch, trainer_logp, tis_cap=1.5, masked=True)
    assert masked.tolist() == [0.0, 1.0, 1.0, 0.0]  # outside [1/1.5, 1.5]: dropped
    assert stats["mismatch/masked_frac"] == pytest.approx(0.5)
    truncated, _ = trainer.rollout_mismatch(batch, trainer_logp, tis_cap=1.5)
    assert truncated.tolist() == pytest.approx([1.5, 0.8187, 1.0, 1.5], abs=1e-4)


def test_async_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="asynchronous.max_staleness > 0 with dynamic_sampling"):
        RLParams(dynamic_sampling=True, asynchronous={"max_staleness": 1})
    with pytest.raises(ValueError, match="less than or equal to 8"):
        RLParams(asynchronous={"max_staleness": 9})


def test_each_iteration_logs_a_sample_of_what_the_trainer_saw(lake_pool, texts):
    logged = []
    p = params(1, log_episodes=2).model_copy(update={"asynchronous": params(1).asynchronous.model_copy(
        update={"correction": "none"})})  # no importance weights: an episode's tokens share its advantage
    hist, _ = run(texts, lake_pool, p, log_episodes=lambda it, eps: logged.append((it, eps)))
    assert [it for it, _ in logged] == [1, 2, 3, 4] and all(len(eps) == 2 for _, eps in logged)
    for it, eps in logged:
        assert len({e["group"] for e in eps}) == 2  # one episode per group
        for e in eps:
            assert e["policy_version"] == (0 if it == 1 else it - 2)  # one version behind, the first on time
            # correction none recomputes nothing before the update: no trainer log-prob to log
            assert e["turns"] and all(t["advantage"] is not None and t["trainer_logp"] is None for t in e["turns"])
            # the advantage of an episode-level estimator (grpo) is the same on every turn of an episode
            assert len({round(t["advantage"], 5) for t in e["turns"]}) == 1
            assert all(t["behaviour_logp"] <= 0 and t["tokens"] > 0 for t in e["turns"])
    # a won episode has its group's highest reward: its advantage is never negative
    assert all(e["turns"][0]["advantage"] >= 0 for _, eps in logged for e in eps if e["won"])


def test_whoever_plays_a_chunk_the_run_is_the_same_bytes(lake_pool, texts, monkeypatch):
    """The rollout processes and the trainer claim an asynchronous flight's chunks (one group each here)
    from one counter: two processes playing every chunk, the trainer playing every one, a thread, or
    two Ray actors (`worker: ray`: a flight's weights sent once through the object store, its chunks
    dealt to the actors) train to the same weights. Without a Ray session `worker: ray` is refused."""
    from agentkiln import fanout
    from agentkiln.config import RayParams
    from agentkiln.trainers import inflight

    torch.set_num_threads(1)  # the thread worker plays on the trainer's threads; the others on one
    p = params(1, rollout_batch=4)  # 2 tasks x 4 episodes: 2 chunks per iteration
    runs = {}
    for who in ("two processes", "trainer", "thread", "two ray actors"):
        with monkeypatch.context() as m:
            if who == "two processes":  # the trainer claims nothing: the processes play every chunk
                m.setattr(inflight.RolloutProcess, "claim", lambda self, fid: None)
            change = {"thread": {"worker": "thread"}, "two processes": {"processes": 2},
                      "trainer": {"processes": 0},  # no rollout process: the trainer plays every chunk
                      "two ray actors": {"worker": "ray", "processes": 2}}.get(who, {})
            q = p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update=change)})
            with fanout.session(RayParams(enabled=who == "two ray actors", num_cpus=2)):
                runs[who] = run(texts, lake_pool, q)
    with pytest.raises(ValueError, match="asynchronous.worker = 'ray' needs a Ray session: set compute.ray.enabled"):
        inflight.RolloutActors(runs["thread"][1], lake_pool[1], p)
    (hist, pol), *others = runs.values()
    assert [h["async/staleness"] for h in hist] == [0, 1, 1, 1]
    for other, pol2 in others:
        assert other == hist
        assert all(torch.equal(a, b) for a, b in zip(pol.model.parameters(), pol2.model.parameters()))


def test_correction_none_recomputes_nothing_and_measures_the_mismatch_on_the_update(lake_pool, texts, monkeypatch):
    calls = []
    real = trainer.score
    monkeypatch.setattr(trainer, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = params(1, kl_coef=0.0).model_copy(update={"minibatch_size": 8})  # one minibatch: its forward pass is on the weights the batch is prepared on
    p = p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update={"correction": "none"})})
    hist, _ = run(texts, lake_pool, p)
    assert calls == []  # no recomputation pass (and kl_coef 0: no reference pass)
    assert hist[0]["mismatch/abs_logp_diff"] < 1e-4  # the first batch was played on the trainer's weights
    assert all(h["mismatch/abs_logp_diff"] > 1e-3 for h in hist[1:] if h["trained_tokens"]), hist
    assert all("mismatch/tis_weight_mean" not in h and "mismatch/alarm" in h for h in hist if h["trained_tokens"])


def test_a_flights_chunks_are_chunk_episodes_on_the_in_process_engine_and_rollout_batch_on_vllm():
    from agentkiln.trainers.inflight import tasks_per_chunk

    p = params(1, rollout_batch=64).model_copy(update={"asynchronous": params(1).asynchronous.model_copy(
        update={"chunk_episodes": 8})})
    assert tasks_per_chunk(p, snapshot=True) == 2  # 8 episodes = 2 groups of 4
    assert tasks_per_chunk(p) == 16  # any other backend (vLLM), a spread synchronous round: rollout_batch's 64 = 16 groups
    unset = p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update={"chunk_episodes": None})})
    assert tasks_per_chunk(unset, snapshot=True) == 16
    assert tasks_per_chunk(p.model_copy(update={"group_size": 16}), snapshot=True) == 1  # never below one group


def test_the_loglinear_proximal_policy_by_hand():
    """log pi_prox = log pi_b + alpha (log pi_theta - log pi_b), alpha = lag / (lag + steps): AReaL's
    loglinear interpolation with versions counted in optimizer steps."""
    from agentkiln.algos.losses import loglinear_proximal

    behaviour = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    theta = torch.tensor([-1.5, -2.2, -0.5, -1.0], requires_grad=True)
    lag = torch.tensor([3.0, 1.0, 0.0, 2.0])
    # the update's first minibatch: pi_theta is the proximal policy itself wherever the behaviour lags
    first = loglinear_proximal(behaviour, theta, lag, steps=0)
    assert first.tolist() == pytest.approx([-1.5, -2.2, -0.5, -1.0])
    assert not first.requires_grad  # a constant of the loss
    # after 1 step: alpha = 3/4, 1/2, 0 (a fresh token: its behaviour policy is the proximal one), 2/3
    later = loglinear_proximal(behaviour, theta, lag, steps=1)
    assert later.tolist() == pytest.approx([-1.0 + 0.75 * -0.5, -2.0 + 0.5 * -0.2, -0.5, -3.0 + 2 / 3 * 2.0])


def test_loglinear_skips_the_recomputation_and_equals_it_on_one_minibatch(lake_pool, texts, monkeypatch):
    """`proximal: loglinear` (the default) runs no scoring pass before the update; with one minibatch per
    update (the proximal policy is the trainer's weights at the one forward pass) it trains what the
    recomputation trains, to float noise; the mismatch is measured on the update's forward passes."""
    calls = []
    real = trainer.score
    monkeypatch.setattr(trainer, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = params(1, kl_coef=0.0).model_copy(update={"minibatch_size": 8})
    assert p.asynchronous.proximal == "loglinear"
    hist, pol = run(texts, lake_pool, p)
    assert calls == []  # no recomputation pass (and kl_coef 0: no reference pass)
    assert [h["async/staleness"] for h in hist] == [0, 1, 1, 1]
    assert [h["optimizer_steps"] for h in hist if h["trained_tokens"]] == [1] * sum(1 for h in hist if h["trained_tokens"])
    assert hist[0]["mismatch/abs_logp_diff"] < 1e-4
    assert all(h["mismatch/abs_logp_diff"] > 1e-3 and "mismatch/is_weight_mean" in h for h in hist[1:] if h["trained_tokens"])
    again, pol_r = run(texts, lake_pool, recomputed(p))
    assert len(calls) == 4  # one recomputation per iteration
    for a, b in zip(hist, again):
        assert a["episodes"] == b["episodes"] and a["success"] == b["success"]
        for key in ("pg_loss", "clip_frac", "ratio_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a, b)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(pol.model.parameters(), pol_r.model.parameters()))


def test_loglinear_interpolates_over_an_updates_minibatches_and_resumes_exactly(lake_pool, texts, tmp_path):
    """With two minibatches per update the second one's proximal log-probs are interpolated (so the run
    differs from the recomputation's), and a resumed run counts the same optimizer steps: the same history."""
    p = params(1)  # minibatch_size 4, 8 episodes per iteration: 2 steps per update where every row trains
    straight, pol_a = run(texts, lake_pool, p)
    recomputed_run, _ = run(texts, lake_pool, recomputed(p))
    assert any(h["optimizer_steps"] == 2 for h in straight)
    assert [h["pg_loss"] for h in straight] != [h["pg_loss"] for h in recomputed_run]

    def kill_at_2(row, step):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        run(texts, lake_pool, p.model_copy(update={"checkpoint_every": 1}), log=kill_at_2, ckpt_dir=tmp_path, ckpt_key="k")
    resumed, pol_b = run(texts, lake_pool, p.model_copy(update={"checkpoint_every": 1}), ckpt_dir=tmp_path, ckpt_key="k")
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(pol_a.model.parameters(), pol_b.model.parameters()))


KILLED_TRAINER = """
import sys
from pathlib import Path
from agentkiln.config import ModelParams, RLParams
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.synthesis.generate import generate
from agentkiln.trainers import rl as trainer
from tests.conftest import task_texts

out = Path(sys.argv[1])
tasks = generate("gym-toytext", 6, seed=3, level="easy", out_dir=out, game="frozenlake")
model = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)
pol = build_scratch_policy(model, task_texts(tasks, out), AgentFormat(), seed=0)
p = RLParams(iterations=100000, tasks_per_iter=2, group_size=4, max_turns=5, minibatch_size=4, rollout_batch=4,
             asynchronous={"max_staleness": 1})
trainer.train_rl(pol, None, tasks, out, p, seed=0, log=lambda row, step: print("iteration", step, flush=True))
"""


def test_the_rollout_process_dies_with_a_killed_trainer(tmp_path):
    """SIGKILL to the trainer (no handler runs): its rollout process goes too (nothing a run starts outlives it)."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # a few iterations: the rollout process is at work
            if line.startswith("iteration 3"):
                break
        children = descendants(proc.pid)
        assert children, "the asynchronous trainer started no rollout process"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if alive(c)], "a rollout process outlived its killed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c[0], signal.SIGKILL)


def test_staleness_two_keeps_two_iterations_in_flight_within_the_bound_and_resumes_exactly(lake_pool, texts, tmp_path):
    """Killed with two flights in flight (launched on different versions), a run resumes to the same
    history and weights: the checkpoint holds every flight's tasks, version and weights."""
    p = params(2).model_copy(update={"iterations": 5})
    straight, pol_a = run(texts, lake_pool, p)
    # iteration 1 launches 2 and 3 on version 0; each later one launches the next on its own version
    assert [h["async/staleness"] for h in straight] == [0, 1, 2, 2, 2]

    def kill_at_3(row, step):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        run(texts, lake_pool, p, log=kill_at_3, ckpt_dir=tmp_path / "ckpt", ckpt_key="k")
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=False)
    # the checkpoint after iteration 2 holds iterations 3 and 4 in flight (0-based 2, 3), on versions 0 and 1
    assert [(f["iteration"], f["version"]) for f in state["in_flight"]] == [(2, 0), (3, 1)]
    resumed, pol_b = run(texts, lake_pool, p, ckpt_dir=tmp_path / "ckpt", ckpt_key="k")
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(pol_a.model.parameters(), pol_b.model.parameters()))


def test_under_lora_a_flight_carries_the_adapters_alone(lake_pool, texts, monkeypatch):
    """Weight sync under LoRA moves the adapters only (the frozen base is in every copy); the run is
    the same bytes whether the rollout process or the trainer plays the chunks."""
    from agentkiln.config import LoRAParams
    from agentkiln.policy import lora
    from agentkiln.trainers import inflight

    torch.set_num_threads(1)
    p = params(1, rollout_batch=4)
    tasks, tasks_dir = lake_pool
    sent: list[set[str]] = []
    real_launch = inflight.RolloutProcess.launch
    runs = []
    for trainer_plays_all in (False, True):
        with monkeypatch.context() as m:
            q = p
            if trainer_plays_all:  # no rollout process: the trainer plays every chunk
                q = p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update={"processes": 0})})
            else:
                m.setattr(inflight.RolloutProcess, "claim", lambda self, fid: None)
                m.setattr(inflight.RolloutProcess, "launch",
                          lambda self, fid, weights, parts, seeds: sent.append(set(weights)) or real_launch(
                              self, fid, weights, parts, seeds))
            pol = lora.add_lora(policy(texts), LoRAParams(enabled=True, r=4, target_modules=["q_proj", "v_proj"]), seed=0)
            runs.append((trainer.train_rl(pol, None, tasks, tasks_dir, p=q, seed=3), pol))
    (hist, pol), (again, pol2) = runs
    assert [h["async/staleness"] for h in hist] == [0, 1, 1, 1] and again == hist
    assert all(torch.equal(a, b) for a, b in zip(pol.model.parameters(), pol2.model.parameters()))
    assert len(sent) == 4 and all(keys and all(".lora_" in k for k in keys) for keys in sent), sent
