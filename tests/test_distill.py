"""Distillation: the KL losses by hand, the three modes end to end on a tiny teacher, on-policy
training on exactly the student's generated tokens, the shared-tokenizer check and the mode param."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from agentkiln.config import DistillParams, ModelParams, ParamsError, load_params
from agentkiln.policy import AgentFormat, build_scratch_policy, load_policy, save_policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.sequence import render
from agentkiln.stages import distill as stage
from agentkiln.synthesis.generate import generate
from agentkiln.trainers import distill as kd
from agentkiln.trainers import select as sel
from agentkiln.trainers import supervised as sup
from agentkiln.trainers.batch import build_batch
from agentkiln.trainers.supervised import OptimConfig, train_supervised

from tests.conftest import expert_episodes, task_texts

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)
STUDENT = ModelParams(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=400, max_context=1024)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- losses by hand
P_T = [0.7, 0.2, 0.1]
P_S = [0.5, 0.3, 0.2]


def logits(*rows):
    return torch.log(torch.tensor(rows))  # softmax(log p) = p


def test_forward_and_reverse_kl_match_hand_computed_values_and_ignore_masked_positions():
    # position 0 is a reply token, position 1 (prompt) is masked: its wildly different rows must not count
    teacher = logits(P_T, [0.98, 0.01, 0.01])
    student = logits(P_S, [0.01, 0.01, 0.98]).requires_grad_()
    mask = torch.tensor([1.0, 0.0])
    fwd = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.2)
    rev = 0.5 * math.log(0.5 / 0.7) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.1)
    assert kd.forward_kl_loss(student, teacher, mask).item() == pytest.approx(fwd, abs=1e-6)
    assert kd.reverse_kl_loss(student, teacher, mask).item() == pytest.approx(rev, abs=1e-6)
    assert fwd != pytest.approx(rev)  # the two directions differ
    # token-mean: two identical unmasked positions give the same value; a [B, T, V] layout works too
    two = kd.forward_kl_loss(logits(P_S, P_S)[None], logits(P_T, P_T)[None], torch.ones(1, 2))
    assert two.item() == pytest.approx(fwd, abs=1e-6)


def test_kl_of_identical_distributions_is_zero_and_only_the_student_gets_gradients():
    student = logits(P_S, [0.2, 0.2, 0.6]).requires_grad_()
    teacher = student.detach().clone().requires_grad_()
    for loss_fn in (kd.forward_kl_loss, kd.reverse_kl_loss):
        assert loss_fn(student, teacher, torch.ones(2)).item() == pytest.approx(0.0, abs=1e-7)
    teacher = logits(P_T, [0.98, 0.01, 0.01]).requires_grad_()
    for loss_fn in (kd.forward_kl_loss, kd.reverse_kl_loss):
        student.grad = None
        loss_fn(student, teacher, torch.tensor([1.0, 0.0])).backward()
        assert teacher.grad is None  # the teacher is a constant
        assert student.grad[0].abs().sum() > 0
        assert torch.equal(student.grad[1], torch.zeros(3))  # a masked position gets no gradient


def test_kd_temperature_softens_both_distributions_and_scales_by_its_square():
    def soft(p, t):
        q = [x ** (1 / t) for x in p]
        return [x / sum(q) for x in q]

    pt, ps = soft(P_T, 2.0), soft(P_S, 2.0)
    fwd = sum(a * math.log(a / b) for a, b in zip(pt, ps))
    rev = sum(b * math.log(b / a) for a, b in zip(pt, ps))
    s, t = logits(P_S), logits(P_T)
    assert kd.forward_kl_loss(s, t, torch.ones(1), temperature=2.0).item() == pytest.approx(4 * fwd, abs=1e-6)
    assert kd.reverse_kl_loss(s, t, torch.ones(1), temperature=2.0).item() == pytest.approx(4 * rev, abs=1e-6)


def test_admissible_support_renormalises_over_the_allowed_tokens():
    allowed = torch.tensor([[True, True, False]])
    pt, ps = [0.7 / 0.9, 0.2 / 0.9], [0.5 / 0.8, 0.3 / 0.8]
    student = logits(P_S).requires_grad_()
    loss = kd.forward_kl_loss(student, logits(P_T), torch.ones(1), allowed=allowed)
    assert loss.item() == pytest.approx(sum(a * math.log(a / b) for a, b in zip(pt, ps)), abs=1e-6)
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[0, 2] == 0  # nothing leaks outside the support
    rev = kd.reverse_kl_loss(logits(P_S), logits(P_T), torch.ones(1), allowed=allowed)
    assert rev.item() == pytest.approx(sum(b * math.log(b / a) for a, b in zip(pt, ps)), abs=1e-6)


# --------------------------------------------------------------------------- a tiny teacher
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Four frozenlake tasks, a teacher SFT'd on their expert walkthroughs (it wins some episodes),
    saved like the rl stage saves its model."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    tasks_dir = root / "tasks"
    tasks = generate("gym-toytext", 4, seed=3, level="easy", out_dir=tasks_dir, game="frozenlake")
    corpus = task_texts(tasks, tasks_dir)
    teacher = build_scratch_policy(TEACHER, corpus, AgentFormat(), seed=0)
    demos = [render(teacher, ep, 16) for ep in expert_episodes(tasks, tasks_dir)]
    train_supervised(teacher, demos, OptimConfig(60, 2, 3e-3, 0.0, 5, 1.0), seed=0)
    save_policy(teacher, root / "teacher")
    return tasks, tasks_dir, root / "teacher", corpus


@pytest.fixture
def params():
    return load_params(ROOT / "params.yaml")


def distill_params(**kw) -> DistillParams:
    base = dict(student=STUDENT, samples_per_task=2, temperature=1.0, max_turns=8, epochs=1, batch_size=2,
                lr=3e-3, warmup_steps=2, iterations=1, tasks_per_iter=3, warmup_epochs=1)
    return DistillParams(**(base | kw))


def run(world, params, monkeypatch, tmp_path, **kw):
    tasks, tasks_dir, teacher_dir, _ = world
    monkeypatch.setattr(stage, "load_split", lambda d, split: tasks[:2] if split == "sft" else tasks[2:])
    p = params.model_copy(update={"distill": distill_params(**kw)})
    return stage.run_distill(p, tasks_dir, teacher_dir, tmp_path / "student")


MODE_KEYS = {
    "trajectory": {"teacher_episodes", "teacher_sample_success", "n_episodes", "final_loss", "teacher_ids"},
    "forward-kl": {"teacher_episodes", "teacher_sample_success", "kept_episodes", "n_tokens", "final_loss"},
    "on-policy": {"teacher_episodes", "warmup_n_episodes", "warmup_final_loss", "student_episodes",
                  "n_tokens", "final_loss", "final_success", "rounds"},
}


@pytest.mark.parametrize("mode", ["trajectory", "forward-kl", "on-policy"])
def test_every_mode_trains_a_smaller_student_and_reports(world, params, monkeypatch, tmp_path, mode):
    steps = []  # (loss, tokens) of every optimizer step of the mode's own objective
    if mode == "trajectory":  # the cross-entropy -mean log p of each step's reply tokens
        real_lp = sup.token_logprobs

        def spy_lp(model, batch, *a, **k):
            logp, ent = real_lp(model, batch, *a, **k)
            if model.training:
                steps.append((float(-logp.detach().mean()), logp.numel()))
            return logp, ent

        monkeypatch.setattr(sup, "token_logprobs", spy_lp)
    else:
        name = "forward_kl_loss" if mode == "forward-kl" else "reverse_kl_loss"
        real_kl = getattr(kd, name)

        def spy_kl(student, teacher, mask, *a, **k):
            loss = real_kl(student, teacher, mask, *a, **k)
            steps.append((float(loss.detach()), len(student)))
            return loss

        monkeypatch.setattr(kd, name, spy_kl)
    report = run(world, params, monkeypatch, tmp_path, mode=mode)
    assert report["mode"] == mode
    assert MODE_KEYS[mode] <= set(report), set(report)
    assert report["student_params"] < report["teacher_params"]
    # one epoch (one on-policy round): final_loss is the token-weighted mean of the losses its steps
    # minimised (recomputed from them here), and a freshly initialised student is not the teacher
    assert steps and report["final_loss"] == pytest.approx(sum(x * n for x, n in steps) / sum(n for _, n in steps),
                                                           rel=1e-6)
    assert report["final_loss"] > 0.1
    assert report["teacher_sample_success"] > 0  # the tiny teacher wins some episodes
    saved = load_policy(tmp_path / "student")
    assert saved.n_params() == report["student_params"]
    assert saved.tokenizer.get_vocab() == load_policy(world[2]).tokenizer.get_vocab()
    if mode == "forward-kl":
        assert report["kept_episodes"] == round(report["teacher_sample_success"] * report["teacher_episodes"])
    if mode == "on-policy":
        assert [r["round"] for r in report["rounds"]] == [1]
        assert report["student_episodes"] == 3 * 2  # tasks_per_iter x samples_per_task
        assert {"loss", "success", "tokens", "teacher_logprob", "grad_norm"} <= set(report["rounds"][0])


def test_forward_kl_keeps_every_teacher_episode_unless_only_successful(world, params, monkeypatch, tmp_path):
    report = run(world, params, monkeypatch, tmp_path, mode="forward-kl", only_successful=False,
                 kd_support="admissible", kd_temperature=2.0)
    assert report["kept_episodes"] == report["teacher_episodes"] and math.isfinite(report["final_loss"])


def test_on_policy_trains_exactly_the_students_generated_tokens(world, params, monkeypatch, tmp_path):
    played, batches, scored = [], [], []
    real_run, real_batch, real_logits = kd.run_episodes, kd.build_batch, kd.reply_logits

    def spy_run(agent, *a, **k):
        eps = real_run(agent, *a, **k)
        played.append((agent.policy, eps))
        return eps

    def spy_batch(episodes, *a, **k):
        batch = real_batch(episodes, *a, **k)
        batches.append((episodes, batch))
        return batch

    def spy_logits(model, batch, vocab):
        scored.append((model, batch))
        return real_logits(model, batch, vocab)

    monkeypatch.setattr(kd, "run_episodes", spy_run)
    monkeypatch.setattr(kd, "build_batch", spy_batch)
    monkeypatch.setattr(kd, "reply_logits", spy_logits)
    report = run(world, params, monkeypatch, tmp_path, mode="on-policy", warmup_epochs=0, iterations=2,
                 batch_size=2)
    assert "warmup_n_episodes" not in report and len(report["rounds"]) == 2
    assert len(played) == 2 and len(batches) == 2
    teacher_vocab = load_policy(world[2]).tokenizer.get_vocab()
    for (policy, eps), (episodes, batch) in zip(played, batches):
        assert policy.tokenizer.get_vocab() == teacher_vocab and policy.n_params() == report["student_params"]
        assert episodes is eps  # the round's own episodes, nothing re-tokenized
        generated = [tok for ep in eps for t in ep.turns for tok in ep.ids[t.start : t.end]]
        assert batch.flat(batch.input_ids).tolist() == generated
        assert batch.rows == sum(len(ep.windows) for ep in eps)
    assert report["n_tokens"] == sum(b.n_tokens for _, b in batches)
    # the student and then the teacher score the very same minibatch each step
    assert len(scored) % 2 == 0 and scored
    for (m_s, b_s), (m_t, b_t) in zip(scored[::2], scored[1::2]):
        assert b_s is b_t and m_s is not m_t


def test_prompt_positions_carry_no_distillation_gradient(world):
    tasks, tasks_dir, teacher_dir, _ = world
    teacher = load_policy(teacher_dir)
    student = stage.build_student(distill_params(), teacher, seed=0)
    eps = run_episodes(PolicyAgent(student, seed=1), tasks[:2], tasks_dir, max_turns=3)
    vocab = kd.shared_vocab(teacher, student, "on-policy")
    batch = build_batch(eps, student.pad_id)
    grads = {}

    def keep_grad(module, inputs, output):  # returns None: the output is left as it is
        output.last_hidden_state.register_hook(lambda g: grads.setdefault("g", g))

    h = student.model.get_decoder().register_forward_hook(keep_grad)
    s_logits = kd.reply_logits(student.model, batch, vocab)
    with torch.no_grad():
        t_logits = kd.reply_logits(teacher.model, batch, vocab)
    kd.reverse_kl_loss(s_logits, t_logits, torch.ones(len(s_logits))).backward()
    h.remove()
    g = grads["g"]
    predicts = torch.zeros(g.shape[:2], dtype=torch.bool)
    pos = batch.loss_mask.nonzero()
    predicts[pos[:, 0], pos[:, 1] - 1] = True
    assert g[~predicts].abs().max() == 0 and g[predicts].abs().max() > 0


def test_trajectory_mode_trains_on_the_teachers_ids_or_renders_for_another_tokenizer(world, params, monkeypatch,
                                                                                     tmp_path):
    assert run(world, params, monkeypatch, tmp_path / "same", mode="trajectory")["teacher_ids"] is True
    _, _, _, corpus = world
    other = build_scratch_policy(STUDENT.model_copy(update={"vocab_size": 320}), corpus, AgentFormat(), seed=0)
    save_policy(other, tmp_path / "other")
    student = STUDENT.model_copy(update={"source": str(tmp_path / "other")})
    report = run(world, params, monkeypatch, tmp_path / "re", mode="trajectory", student=student)
    assert report["teacher_ids"] is False and report["n_episodes"] > 0


# --------------------------------------------------------------------------- tokenizers, params
@pytest.mark.parametrize("mode", ["forward-kl", "on-policy"])
def test_token_level_modes_refuse_a_student_with_another_tokenizer(world, params, monkeypatch, tmp_path, mode):
    _, _, teacher_dir, corpus = world
    other = build_scratch_policy(STUDENT.model_copy(update={"vocab_size": 320}), corpus, AgentFormat(), seed=0)
    save_policy(other, tmp_path / "other")
    n_teacher, n_student = len(load_policy(teacher_dir).tokenizer), len(other.tokenizer)
    assert n_teacher != n_student
    student = STUDENT.model_copy(update={"source": str(tmp_path / "other")})
    with pytest.raises(ValueError) as e:
        run(world, params, monkeypatch, tmp_path, mode=mode, student=student)
    msg = str(e.value)
    assert f"distill.mode {mode}" in msg and "use distill.mode: trajectory" in msg
    assert f"teacher vocabulary {n_teacher} tokens, student vocabulary {n_student} tokens" in msg


def test_same_size_vocabularies_with_other_ids_are_refused():
    a = build_scratch_policy(STUDENT, ["go east go east go west"], AgentFormat(), seed=0)
    b = build_scratch_policy(STUDENT, ["go west go west go east"], AgentFormat(), seed=0)
    assert len(a.tokenizer) == len(b.tokenizer) and a.tokenizer.get_vocab() != b.tokenizer.get_vocab()
    with pytest.raises(ValueError, match="different tokens or ids"):
        kd.shared_vocab(a, b, "forward-kl")
    assert kd.shared_vocab(a, a, "on-policy") == len(a.tokenizer)


def test_an_unknown_distill_mode_is_refused_naming_the_field(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert raw["distill"]["mode"] == "trajectory"  # the measured default
    raw["distill"]["mode"] = "reverse-kl"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ParamsError, match=r"distill\.mode = 'reverse-kl'"):
        load_params(path)


@pytest.mark.parametrize("mode", ["forward-kl", "on-policy"])
def test_token_level_modes_are_deterministic_given_the_seed(world, params, monkeypatch, tmp_path, mode):
    a = run(world, params, monkeypatch, tmp_path / "a", mode=mode, only_successful=False)
    b = run(world, params, monkeypatch, tmp_path / "b", mode=mode, only_successful=False)
    assert a == b
    for x, y in zip(load_policy(tmp_path / "a" / "student").model.parameters(),
                    load_policy(tmp_path / "b" / "student").model.parameters()):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------- restarts
def straight(world, params, seed: int, p: DistillParams):
    """The student of `seed` trained the whole schedule in one go on the stage's teacher wins."""
    tasks, tasks_dir, teacher_dir, _ = world
    teacher = load_policy(teacher_dir)
    won = [e for e in stage.teacher_episodes(teacher, tasks[:2] + tasks[2:], tasks_dir, p, params.seed) if e.won]
    student = stage.build_student(p, teacher, seed, params.compute)
    train_supervised(student, won, stage.replace(stage.optim_config(p), epochs=p.epochs), seed=seed)
    return student


def test_restarts_keep_the_student_best_on_the_panel_and_train_it_on_as_if_never_stopped(world, params, monkeypatch,
                                                                                          tmp_path):
    """Three students train one epoch each and play the panel; the panel's success is scripted here
    (0.2, 0.5, 0.5) so the rule shows: the best, ties to the lower seed, is seed + 1. It then trains its
    second epoch from its checkpoint: its weights are those of seed + 1's student trained both epochs at
    once. Each student played the real panel (the episodes went through the real engine)."""
    played, scripted = [], iter([0.2, 0.5, 0.5])
    real_success = sel.family_success

    def scores(won):
        played.append(len(won))
        return real_success(won) | {"all": next(scripted)}

    monkeypatch.setattr(sel, "family_success", scores)  # what play_panel scores the panel with
    kw = dict(restarts=3, restart_epochs=1, epochs=2)
    report = run(world, params, monkeypatch, tmp_path, **kw)
    assert played == [2, 2, 2]  # every student played the panel's two tasks
    assert [look["seed"] for look in report["restart_looks"]] == [params.seed, params.seed + 1, params.seed + 2]
    assert [look["all"] for look in report["restart_looks"]] == [0.2, 0.5, 0.5]
    assert report["restart_seed"] == params.seed + 1
    want = straight(world, params, params.seed + 1, distill_params(**kw))
    got = load_policy(tmp_path / "student")
    for x, y in zip(got.model.parameters(), want.model.parameters()):
        assert torch.equal(x, y)
    other = straight(world, params, params.seed, distill_params(**kw))  # and it is not the first seed's
    assert any(not torch.equal(x, y) for x, y in zip(got.model.parameters(), other.model.parameters()))


def test_one_restart_is_the_single_student_and_a_resumed_choice_plays_no_student_again(world, params, monkeypatch,
                                                                                       tmp_path):
    tasks, tasks_dir, teacher_dir, _ = world
    one = run(world, params, monkeypatch, tmp_path / "one", restarts=1, epochs=2)
    assert "restart_looks" not in one
    p = params.model_copy(update={"distill": distill_params(restarts=2, restart_epochs=1, epochs=2)})
    teacher = load_policy(teacher_dir)
    won = [e for e in stage.teacher_episodes(teacher, tasks, tasks_dir, p.distill, p.seed) if e.won]
    cfg = stage.replace(stage.optim_config(p.distill), epochs=2)
    monkeypatch.setattr(stage, "load_split", lambda d, split: tasks[2:])
    slot = {"ckpt_dir": tmp_path / "ckpt" / "distill", "ckpt_key": "k:distill"}

    def choose():
        first = stage.build_student(p.distill, teacher, p.seed, p.compute)
        return stage.train_restarts(p, teacher, first, won, won, tasks_dir, cfg, "distill", slot)

    student, seed, looks, history = choose()
    from agentkiln.trainers import checkpoint

    done = [checkpoint.load(slot["ckpt_dir"] / f"r{r}", f"k:distill:r{r}")["done"] for r in range(2)]
    assert done[seed - p.seed] == 2 and done[1 - (seed - p.seed)] == 1  # the dropped student stopped at its look
    calls = []
    monkeypatch.setattr(stage, "run_episodes", lambda *a, **k: calls.append(a) or [])
    again, seed2, looks2, history2 = choose()  # as a stage resumed after its students played
    assert calls == [] and (seed2, looks2, history2) == (seed, looks, history)
    for x, y in zip(again.model.parameters(), student.model.parameters()):
        assert torch.equal(x, y)
    if seed == p.seed:  # seed's student chosen: the same weights as no restarts
        for x, y in zip(student.model.parameters(), load_policy(tmp_path / "one" / "student").model.parameters()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("distill, said", [
    ({"restart_panel": "test"}, "the headline panel"),
    ({"restart_panel": "holdout"}, "no such split"),
    ({"epochs": 12, "restart_epochs": 12}, "is not below distill.epochs = 12"),
    ({"mode": "forward-kl"}, "trajectory phase only"),
    ({"mode": "on-policy", "warmup_epochs": 4}, "is not below distill.warmup_epochs = 4"),
])
def test_restarts_are_refused_where_they_cannot_choose_honestly(distill, said):
    from pydantic import ValidationError

    from tests.conftest import params_with

    assert params_with({}).distill.restarts == 1 and params_with({}).distill.restart_panel == "val"  # the default
    params_with({"distill": distill | {"restarts": 1}})  # one student: nothing is chosen, nothing refused
    with pytest.raises(ValidationError, match=rf"distill\.\w+ = .*{said}"):
        params_with({"distill": distill | {"restarts": 2}})
