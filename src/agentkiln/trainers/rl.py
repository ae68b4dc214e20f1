"""The RL trainer: one loop for GRPO, Dr.GRPO, RLOO, REINFORCE++, GiGPO and PPO/GAE.

One iteration, top to bottom:
1. `collect`: sample tasks from the pool, play G episodes per task from the same initial state
   (rollout keeps the exact generated ids, the constrained-decoding masks and the behaviour
   log-probs); with dynamic sampling, groups whose rewards do not vary are dropped and more tasks
   are played until the batch is full.
2. `credit.shape_rewards` + `credit.token_advantages`: one advantage per generated token.
3. `update`: PPO epochs over minibatches of turns (micro-batches accumulate gradients): PPO-clip
   (clip-higher, dual clip) or GSPO, KL to the stage's starting policy as a loss term (or folded
   into the rewards), entropy bonus, gradient clipping; PPO also fits its critic.
4. Health metrics (entropy, KL, clip fraction, grad norm, reply length, zero-variance groups,
   success per task type) and, every `checkpoint_every` iterations, a resumable checkpoint.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from agentkiln.algos.losses import aggregate, gspo, kl_penalty, ppo_clip
from agentkiln.config import RLParams
from agentkiln.envs import TaskSpec
from agentkiln.policy.model import Policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import Episode, run_episodes
from agentkiln.trainers import checkpoint
from agentkiln.trainers.batch import Sample, make_batch, reply_logprobs
from agentkiln.trainers.credit import shape_rewards, token_advantages
from agentkiln.trainers.critic import Critic, value_loss


FAULT_ENV = "AGENTKILN_KILL_AFTER_ITERATION"


class InjectedFault(RuntimeError):
    """Raised where FAULT_ENV says, like a crash: a failure that unwinds (a SIGKILL would leave
    Prefect's temporary API server of the stage process running)."""


@dataclass
class TurnSample:
    """One turn to train on: its exact ids, behaviour log-probs and per-token advantages."""

    sample: Sample
    old_logp: list[float]
    adv: list[float]
    old_value: float = 0.0  # PPO: critic's value at rollout time and its target
    ret: float = 0.0


def collect(policy: Policy, pool: list[TaskSpec], tasks_dir: Path, p: RLParams, rng: random.Random, seed: int,
            budget_left: int | None = None) -> tuple[list[Episode], list[Episode], dict]:
    """(episodes to train on: `tasks_per_iter` groups, with dynamic sampling only groups whose shaped
    rewards vary; every episode played, for the metrics; stats). Dynamic sampling stops playing
    more rounds once `budget_left` episodes were played."""
    kept: list[Episode] = []
    everything: list[Episode] = []
    groups_seen = groups_flat = played = 0
    rounds = p.max_sample_rounds if p.dynamic_sampling else 1
    for r in range(rounds):
        tasks = rng.sample(pool, min(p.tasks_per_iter, len(pool)))
        agent = PolicyAgent(policy, temperature=p.temperature, seed=seed + r, decoding=p.decoding)
        episodes = run_episodes(agent, tasks, tasks_dir, p.max_turns, group_size=p.group_size)
        played += len(episodes)
        everything += episodes
        scores = [sum(sum(t) for t in ep) for ep in shape_rewards(episodes, p)]
        by_group: dict[int, list[int]] = defaultdict(list)
        for i, ep in enumerate(episodes):
            by_group[ep.group].append(i)
        for idx in by_group.values():
            groups_seen += 1
            flat = len({scores[i] for i in idx}) == 1
            groups_flat += flat
            if flat and p.dynamic_sampling:
                continue
            n_groups = len({ep.group for ep in kept})
            if n_groups >= p.tasks_per_iter:
                break
            for i in idx:
                episodes[i].group = n_groups  # unique across rounds
                kept.append(episodes[i])
        if len({ep.group for ep in kept}) >= p.tasks_per_iter or (budget_left is not None and played >= budget_left):
            break
    return kept, everything, {"episodes_played": played, "zero_var_groups": groups_flat / max(1, groups_seen),
                  "groups_trained": len({ep.group for ep in kept}), "sample_rounds": r + 1}


@torch.no_grad()
def _ref_logprobs(ref: Policy, episodes: list[Episode], temperature: float, batch: int = 64) -> list[list[list[float]]]:
    vocab = ref.model.get_input_embeddings().num_embeddings
    turns = [t for ep in episodes for t in ep.turns]
    flat: list[float] = []
    for i in range(0, len(turns), batch):
        chunk = [Sample(t.gen.prompt_ids, t.gen.ids, t.gen.allowed) for t in turns[i : i + batch]]
        flat += reply_logprobs(ref.model, make_batch(chunk, ref.pad_id, vocab), temperature)[0].tolist()
    out, k = [], 0
    for ep in episodes:
        per_turn = []
        for t in ep.turns:
            per_turn.append(flat[k : k + len(t.gen.ids)])
            k += len(t.gen.ids)
        out.append(per_turn)
    return out


def build_samples(policy: Policy, ref: Policy, critic: Critic | None, episodes: list[Episode], p: RLParams
                  ) -> list[TurnSample]:
    """Shaped rewards -> advantages -> the turns to train on (all-zero-advantage turns carry no signal)."""
    token_kl = None
    if p.kl_in_reward and p.kl_coef > 0:
        ref_lp = _ref_logprobs(ref, episodes, p.temperature)
        token_kl = [[kl_penalty(torch.tensor(t.gen.logprobs), torch.tensor(r), p.kl_estimator).tolist()
                     for t, r in zip(ep.turns, ep_r)] for ep, ep_r in zip(episodes, ref_lp)]
    rewards = shape_rewards(episodes, p, token_kl)
    values = None
    if critic is not None:
        flat = critic.values([t.gen.prompt_ids for ep in episodes for t in ep.turns], policy.pad_id)
        values, k = [], 0
        for ep in episodes:
            values.append(flat[k : k + len(ep.turns)])
            k += len(ep.turns)
    adv, returns = token_advantages(p.algorithm, episodes, rewards, p, values)
    out = []
    for e, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns):
            if critic is None and not any(adv[e][t]):
                continue
            g = turn.gen
            out.append(TurnSample(Sample(g.prompt_ids, g.ids, g.allowed), g.logprobs, adv[e][t],
                                  values[e][t] if values else 0.0, returns[e][t] if returns else 0.0))
    return out


def _micro_loss(policy: Policy, ref: Policy, micro: list[TurnSample], p: RLParams, share: float, norm_len: float
                ) -> dict:
    """Backpropagate one micro-batch's loss, weighted by its `share` of the minibatch; return its stats."""
    vocab = policy.model.get_input_embeddings().num_embeddings
    batch = make_batch([s.sample for s in micro], policy.pad_id, vocab)
    logp, entropy = reply_logprobs(policy.model, batch, p.temperature)
    old = torch.tensor([x for s in micro for x in s.old_logp])
    adv = torch.tensor([x for s in micro for x in s.adv])
    seq_ids = torch.repeat_interleave(torch.arange(len(micro)), torch.tensor([len(s.adv) for s in micro]))
    if p.policy_loss == "gspo":
        pg, info = gspo(logp, old, adv, seq_ids, p.clip_low, p.clip_high)
    else:
        pg, info = ppo_clip(logp, old, adv, p.clip_low, p.clip_high, p.dual_clip, p.loss_agg, seq_ids, norm_len)
    with torch.no_grad():
        ref_logp, _ = reply_logprobs(ref.model, batch, p.temperature)
    kl = aggregate(kl_penalty(logp, ref_logp, p.kl_estimator), p.loss_agg, seq_ids, norm_len)
    ent = aggregate(entropy, p.loss_agg, seq_ids, norm_len)
    loss = pg
    if p.kl_coef > 0 and not p.kl_in_reward:
        loss = loss + p.kl_coef * kl
    if p.entropy_coef > 0:
        loss = loss - p.entropy_coef * ent
    (loss * share).backward()
    stats = {"loss": float(loss.detach()), "pg_loss": float(pg.detach()), "kl": float(kl.detach()),
             "entropy": float(ent.detach()),
             "clip_frac": info["clip_frac"], "ratio_mean": info["ratio_mean"]}
    return stats


def update(policy: Policy, ref: Policy, critic: Critic | None, samples: list[TurnSample], p: RLParams,
           opt: torch.optim.Optimizer, critic_opt: torch.optim.Optimizer | None, gen: torch.Generator) -> dict:
    """PPO epochs over shuffled minibatches; gradients of micro-batches accumulate to exactly the
    minibatch's loss (each micro loss is weighted by its share of the aggregation's denominator)."""
    stats: dict[str, list[float]] = defaultdict(list)
    micro_size = p.micro_batch_size or p.minibatch_size
    token_level = p.loss_agg == "token-mean" and p.policy_loss == "ppo"  # share of tokens, else of sequences
    policy.model.train()
    for _ in range(p.ppo_epochs):
        order = torch.randperm(len(samples), generator=gen).tolist()
        for i in range(0, len(order), p.minibatch_size):
            mb = [samples[j] for j in order[i : i + p.minibatch_size]]
            n_tok = sum(len(s.adv) for s in mb)
            norm_len = float(max(len(s.adv) for s in mb))
            opt.zero_grad(set_to_none=True)
            for k in range(0, len(mb), micro_size):
                micro = mb[k : k + micro_size]
                share = (sum(len(s.adv) for s in micro) / n_tok) if token_level else len(micro) / len(mb)
                st = _micro_loss(policy, ref, micro, p, share, norm_len)
                for key, v in st.items():
                    stats[key].append(v)
            stats["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), p.max_grad_norm)))
            opt.step()
            if critic is not None:
                critic.train()
                critic_opt.zero_grad(set_to_none=True)
                for k in range(0, len(mb), micro_size):
                    micro = mb[k : k + micro_size]
                    v = critic([s.sample.prompt_ids for s in micro], policy.pad_id)
                    vl = value_loss(v, torch.tensor([s.old_value for s in micro]), torch.tensor([s.ret for s in micro]),
                                    p.value_clip)
                    (vl * len(micro) / len(mb)).backward()
                    stats["value_loss"].append(float(vl.detach()))
                torch.nn.utils.clip_grad_norm_(critic.parameters(), p.max_grad_norm)
                critic_opt.step()
    policy.model.eval()
    return {k: sum(v) / len(v) for k, v in stats.items() if v}


def episode_metrics(episodes: list[Episode], samples: list[TurnSample]) -> dict:
    """Health of one iteration: over every episode played (before dynamic sampling's filter)."""
    turns = [t for ep in episodes for t in ep.turns]
    row = {
        "reward_mean": sum(ep.reward for ep in episodes) / len(episodes),
        "success": sum(ep.won for ep in episodes) / len(episodes),
        "turns_mean": len(turns) / len(episodes),
        "response_tokens": sum(len(t.gen.ids) for t in turns) / max(1, len(turns)),
        "invalid_rate": sum(t.invalid for t in turns) / max(1, len(turns)),
        "truncated_rate": sum(ep.truncated for ep in episodes) / len(episodes),
        "trained_turns": len(samples),
        "adv_abs_mean": sum(abs(a) for s in samples for a in s.adv) / max(1, sum(len(s.adv) for s in samples)),
    }
    by_type: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        by_type[ep.task_type or ep.family].append(ep.won)
    row |= {f"success/{k}": sum(v) / len(v) for k, v in sorted(by_type.items())}
    return row


def greedy_success(policy: Policy, tasks: list[TaskSpec], tasks_dir: Path, max_turns: int | None, desc: str,
                   decoding: str = "constrained") -> float:
    eps = run_episodes(PolicyAgent(policy, greedy=True, decoding=decoding), tasks, tasks_dir, max_turns, progress=desc)
    return sum(e.won for e in eps) / len(eps)


def train_rl(
    policy: Policy,
    ref: Policy,
    pool: list[TaskSpec],
    tasks_dir: Path,
    p: RLParams,
    seed: int,
    log: Callable[[dict, int], None] | None = None,
    ckpt_dir: Path | None = None,
    ckpt_key: str = "",
) -> list[dict]:
    """Train `policy` in place on `pool`; `ref` (the stage's starting policy) stays frozen. With
    `ckpt_dir`, resumes from a checkpoint of the same run (`ckpt_key`) and writes new ones.
    Returns per-iteration metrics."""
    ref.model.eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=p.lr, weight_decay=0.0)
    critic = critic_opt = None
    if p.algorithm == "ppo":
        critic = Critic(policy.model)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=0.0)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    start = played = 0
    state = checkpoint.load(ckpt_dir, ckpt_key, rng, gen) if ckpt_dir else None
    if state is not None:
        policy.model.load_state_dict(state["policy"])
        opt.load_state_dict(state["opt"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
            critic_opt.load_state_dict(state["critic_opt"])
        start, played, history = state["iteration"], state["played"], state["history"]
        print(f"rl: resumed from {ckpt_dir} after iteration {start}")
        if log:  # the new tracking run gets the whole curve
            for row in history:
                log({f"rl/{k}": v for k, v in row.items() if k != "iteration"}, row["iteration"])
    total = p.iterations
    if p.episode_budget is not None and not p.dynamic_sampling:  # the budget, not iterations, ends the run
        total = min(total, -(-p.episode_budget // (min(p.tasks_per_iter, len(pool)) * p.group_size)))
    for it in tqdm(range(start, p.iterations), desc="rl iterations", initial=start, total=total):
        if p.episode_budget is not None and played >= p.episode_budget:
            break
        episodes, everything, info = collect(policy, pool, tasks_dir, p, rng, seed * 100_003 + it * 101,
                                             None if p.episode_budget is None else p.episode_budget - played)
        played += info["episodes_played"]
        samples = build_samples(policy, ref, critic, episodes, p) if episodes else []
        row = {"iteration": it + 1, "episodes": played, **info, **episode_metrics(everything, samples)}
        if samples:
            row |= update(policy, ref, critic, samples, p, opt, critic_opt, gen)
        history.append(row)
        if log:
            log({f"rl/{k}": v for k, v in row.items() if k != "iteration"}, it + 1)
        if ckpt_dir and p.checkpoint_every and (it + 1) % p.checkpoint_every == 0:
            checkpoint.save(ckpt_dir, ckpt_key, {
                "policy": policy.model.state_dict(), "opt": opt.state_dict(), "iteration": it + 1, "played": played,
                "history": history, "critic": critic.state_dict() if critic else None,
                "critic_opt": critic_opt.state_dict() if critic_opt else None}, rng, gen)
        if os.environ.get(FAULT_ENV) == str(it + 1):  # fault injection: the resume test stops the stage here
            raise InjectedFault(f"{FAULT_ENV}={it + 1}: stopped after the checkpoint of iteration {it + 1}")
    return history
