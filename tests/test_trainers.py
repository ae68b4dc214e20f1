"""Trainers on a tiny model: SFT on whole expert episodes fits them (loss by value, then greedy replay);
one RL update moves probability toward the positive-advantage replies; save/load round-trips the
policy, its chat format and its agent format; SFT's loss skips a recovery episode's mistake replies."""

import json
import random

import torch

from agentkiln.config import ModelParams, RLParams
from agentkiln.policy import AgentFormat, build_scratch_policy, load_policy, save_policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.sequence import render
from agentkiln.synthesis.recovery import recovery_episode
from agentkiln.trainers.batch import build_batch, token_logprobs
from agentkiln.trainers.engine import LocalEngine
from agentkiln.trainers.rl import update
from agentkiln.trainers.supervised import OptimConfig, sft_batch, train_supervised

from tests.conftest import expert_episodes, task_texts

TINY = ModelParams(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, vocab_size=400, max_context=1024)


def test_sft_on_whole_episodes_learns_the_expert(lake_pool):
    tasks, tasks_dir = lake_pool
    torch.manual_seed(0)
    pol = build_scratch_policy(TINY, task_texts(tasks, tasks_dir), AgentFormat(), seed=0)
    demos = [render(pol, ep, 16) for ep in expert_episodes(tasks, tasks_dir)]
    assert all(len(ep.windows) == 1 and ep.n_tokens == sum(len(pol.chat.reply(t.action)) for t in ep.turns)
               for ep in demos)
    # lr 3e-3: at 1e-2 the end of training was at the edge of stability (final token accuracy 0.92-0.96
    # and 2-5 replays won, by the CPU's kernels: AVX2 or AVX-512, MKL's code path); here 0.986-1.0, 5-6
    cfg = OptimConfig(epochs=100, batch_size=2, lr=3e-3, weight_decay=0.0, warmup_steps=2, max_grad_norm=1.0)
    hist = train_supervised(pol, demos, cfg, seed=0)
    assert hist[0]["loss"] > 1.0 and hist[-1]["loss"] < 0.05 * hist[0]["loss"] and hist[-1]["token_acc"] > 0.95
    played = run_episodes(PolicyAgent(pol, greedy=True), tasks, tasks_dir, None)
    assert sum(ep.won for ep in played) >= 4  # it replays its training walkthroughs (a random policy wins ~1 in 20)


def test_rl_update_raises_logprob_of_positive_advantage_replies(lake_pool):
    tasks, tasks_dir = lake_pool
    torch.manual_seed(0)
    pol = build_scratch_policy(TINY, task_texts(tasks, tasks_dir), AgentFormat(), seed=0)
    eps = run_episodes(PolicyAgent(pol, seed=0, temperature=1.0), tasks[:1], tasks_dir, 1, group_size=16)
    good = eps[0].turns[0].action
    batch = build_batch(eps, pol.pad_id)
    sign = torch.tensor([1.0 if ep.turns[0].action == good else -1.0 for ep in eps])
    batch.advantages = sign[batch.episode][:, None] * batch.loss_mask
    before, _ = token_logprobs(pol.model, batch, with_entropy=False)
    opt = torch.optim.AdamW(pol.model.parameters(), lr=1e-2)
    p = RLParams(minibatch_size=16, kl_coef=0.0)
    stats = update(LocalEngine(pol.model, opt, p.max_grad_norm), pol, None, batch, p, None, torch.Generator().manual_seed(0))
    after, _ = token_logprobs(pol.model, batch, with_entropy=False)
    rows = (sign > 0)[batch.seq_ids()]
    assert after[rows].sum() > before[rows].sum() and after[~rows].sum() < before[~rows].sum()
    assert {"loss", "pg_loss", "clip_frac", "entropy", "grad_norm"} <= set(stats)


def test_save_and_load_round_trip(lake_pool, tmp_path):
    tasks, tasks_dir = lake_pool
    pol = build_scratch_policy(TINY, task_texts(tasks, tasks_dir), AgentFormat(show_admissible=False), seed=0)
    save_policy(pol, tmp_path / "p")
    back = load_policy(tmp_path / "p")
    assert back.fmt == pol.fmt and back.max_context == pol.max_context == 1024
    assert back.chat.reply("go north") == pol.chat.reply("go north") and back.chat.end_id == pol.chat.end_id
    a = run_episodes(PolicyAgent(pol, greedy=True), tasks[:2], tasks_dir, 3)
    b = run_episodes(PolicyAgent(back, greedy=True), tasks[:2], tasks_dir, 3)
    assert [e.ids for e in a] == [e.ids for e in b]
    assert all("Actions:" not in pol.tokenizer.decode(e.ids) for e in a)  # the saved format is the one played


def test_sft_loss_mask_skips_exactly_the_mistake_replies(lake_pool):
    """STeP's partial masking: a recovery episode's injected mistakes stay in the conversation (their
    ids are in the rows, the later replies are scored after them) but none of their reply tokens is a
    target; every other reply token still is."""
    tasks, tasks_dir = lake_pool
    pol = build_scratch_policy(TINY, task_texts(tasks, tasks_dir), AgentFormat(), seed=0)
    eps = []
    for j, task in enumerate(tasks[:3]):
        rows = next(r for k in range(50) if (r := recovery_episode(task, tasks_dir, 40, task.expert_steps, (1, 2),
                                                                   random.Random(f"{j}:{k}"))) is not None)
        ep = Episode(task.task_id, task.family, j, goal=rows[0]["goal"], won=True)
        ep.turns = [Turn(r["observation"], json.loads(r["admissible"]), "", reply=r["action"], action=r["action"],
                         mistake=r["mistake"]) for r in rows]
        eps.append(render(pol, ep, 16))
    assert all(any(t.mistake for t in ep.turns) and not all(t.mistake for t in ep.turns) for ep in eps)
    full, sft = build_batch(eps, pol.pad_id), sft_batch(pol, eps)
    assert torch.equal(full.input_ids, sft.input_ids)  # the mistakes are still context
    expected = full.loss_mask.clone()
    for r, e in enumerate(full.episode.tolist()):
        for t in eps[e].turns:
            if t.mistake:
                assert expected[r, t.start:t.end].all()
                expected[r, t.start:t.end] = False
    assert torch.equal(sft.loss_mask, expected) and sft.n_tokens < full.n_tokens
    with torch.no_grad():
        logp_full, _ = token_logprobs(pol.model, full, with_entropy=False)
        logp_sft, _ = token_logprobs(pol.model, sft, with_entropy=False)
    assert torch.allclose(logp_sft, logp_full[expected[full.loss_mask]])
    cfg = OptimConfig(epochs=1, batch_size=2, lr=1e-3, weight_decay=0.0, warmup_steps=1, max_grad_norm=1.0)
    assert train_supervised(pol, eps, cfg, seed=0)[0]["loss"] > 0
