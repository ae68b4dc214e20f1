"""GRPO with a PPO-clip loss and a k3 KL penalty to the frozen SFT reference.

One iteration: sample tasks from the RL pool -> G episodes per task from the same initial state
(rollout keeps the exact generated ids and the constrained-decoding masks) -> outcome reward ->
GRPO advantage per episode, broadcast to each of its action tokens -> PPO-clip + KL -> update.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from agentkiln.algos.advantages import grpo
from agentkiln.algos.losses import kl_k3, ppo_clip
from agentkiln.config import RLParams
from agentkiln.envs import TaskSpec
from agentkiln.policy.model import Policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import Episode, run_episodes
from agentkiln.trainers.batch import Sample, make_batch, reply_logprobs


def episode_samples(episodes: list[Episode], adv: torch.Tensor) -> tuple[list[Sample], list[float], list[float]]:
    """Every turn of every episode with a non-zero advantage becomes one training sample."""
    samples, old_logp, token_adv = [], [], []
    for ep, a in zip(episodes, adv.tolist()):
        if a == 0.0:
            continue  # zero-variance group: no policy-gradient signal
        for turn in ep.turns:
            g = turn.gen
            samples.append(Sample(g.prompt_ids, g.ids, g.allowed))
            old_logp += g.logprobs
            token_adv += [a] * len(g.ids)
    return samples, old_logp, token_adv


def rl_step(
    policy: Policy, ref: Policy, samples: list[Sample], old_logp: list[float], token_adv: list[float],
    params: RLParams, opt: torch.optim.Optimizer, gen: torch.Generator,
) -> dict:
    """PPO epochs over minibatches of turns; returns averaged training-health stats."""
    vocab = policy.model.get_input_embeddings().num_embeddings
    # token offsets of each sample inside the flat old_logp / token_adv lists
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s.reply_ids))
    stats: dict[str, list[float]] = {k: [] for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm")}
    policy.model.train()
    for _ in range(params.ppo_epochs):
        order = torch.randperm(len(samples), generator=gen).tolist()
        for i in range(0, len(order), params.minibatch_size):
            idx = order[i : i + params.minibatch_size]
            batch = make_batch([samples[j] for j in idx], policy.pad_id, vocab)
            tok = [t for j in idx for t in range(offsets[j], offsets[j + 1])]
            old = torch.tensor([old_logp[t] for t in tok])
            adv = torch.tensor([token_adv[t] for t in tok])
            with torch.no_grad():
                ref_logp, _ = reply_logprobs(ref.model, batch, params.temperature)
            logp, entropy = reply_logprobs(policy.model, batch, params.temperature)
            pg, info = ppo_clip(logp, old, adv, params.clip_low, params.clip_high)
            kl = kl_k3(logp, ref_logp).mean()
            loss = pg + params.kl_coef * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), params.max_grad_norm)
            opt.step()
            for k, v in (("loss", loss), ("pg_loss", pg), ("kl", kl), ("entropy", entropy.mean()),
                         ("clip_frac", info["clip_frac"]), ("grad_norm", grad_norm)):
                stats[k].append(float(v.detach()) if torch.is_tensor(v) else float(v))
    policy.model.eval()
    return {k: sum(v) / len(v) for k, v in stats.items() if v}


def greedy_success(policy: Policy, tasks: list[TaskSpec], tasks_dir: Path, max_turns: int, desc: str) -> float:
    eps = run_episodes(PolicyAgent(policy, greedy=True), tasks, tasks_dir, max_turns, progress=desc)
    return sum(e.won for e in eps) / len(eps)


def train_rl(
    policy: Policy,
    ref: Policy,
    pool: list[TaskSpec],
    tasks_dir: Path,
    params: RLParams,
    seed: int,
    log: Callable[[dict, int], None] | None = None,
) -> list[dict]:
    """Train `policy` in place on the RL pool; `ref` stays frozen. Returns per-iteration metrics."""
    ref.model.eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=params.lr, weight_decay=0.0)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for it in tqdm(range(params.iterations), desc="rl iterations"):
        tasks = rng.sample(pool, min(params.tasks_per_iter, len(pool)))
        agent = PolicyAgent(policy, temperature=params.temperature, seed=seed * 100_003 + it)
        episodes = run_episodes(agent, tasks, tasks_dir, params.max_turns, group_size=params.group_size)
        rewards = torch.tensor([e.reward for e in episodes])
        groups = torch.tensor([e.group for e in episodes])
        adv = grpo(rewards, groups)
        group_std = torch.stack([rewards[groups == g].std() for g in groups.unique()])
        row = {
            "iteration": it + 1,
            "reward_mean": float(rewards.mean()),
            "success": sum(e.won for e in episodes) / len(episodes),
            "turns_mean": sum(len(e.turns) for e in episodes) / len(episodes),
            "zero_var_groups": float((group_std == 0).float().mean()),
        }
        samples, old_logp, token_adv = episode_samples(episodes, adv)
        if samples:
            row |= rl_step(policy, ref, samples, old_logp, token_adv, params, opt, gen)
        row["trained_turns"] = len(samples)
        history.append(row)
        if log:
            log({f"rl/{k}": v for k, v in row.items() if k != "iteration"}, it + 1)
    return history
