"""The RL trainer: one loop for GRPO, Dr.GRPO, RLOO, REINFORCE++, GiGPO and PPO/GAE.

One iteration, top to bottom:
1. `collect`: sample tasks from the pool, play G episodes per task from the same initial state with
   the rollout backend (rollout.backends: the in-process KV-cache engine, or vLLM with the weights
   synced first); each episode is one token sequence: the exact generated ids, the
   constrained-decoding masks and the behaviour log-probs. With dynamic sampling, groups whose
   rewards do not vary are dropped and more tasks are played until the batch is full. With
   `offline.split`, a collected split's episodes (an agent harness's, ids and log-probs as served by
   `agentkiln endpoint`) join the batch (trainers.offline).
2. `prepare`: one flat batch of tensors (trainers.batch); with an out-of-process rollout the trainer
   recomputes the behaviour log-probs and logs the mismatch (truncated importance sampling weights
   the advantages when `tis_cap` is set); the reference's log-probs (KL: a frozen copy, or with LoRA
   the same model with its adapters off), the critic's values (PPO), then `credit.advantages`.
3. `update`: PPO epochs over minibatches of episodes (micro-batches accumulate gradients): PPO-clip
   (clip-higher, dual clip) or GSPO, KL to the stage's starting policy as a loss term (or folded into
   the rewards), entropy bonus, gradient clipping; PPO also fits its critic.
4. Health metrics (entropy, KL, clip fraction, grad norm, reply length, zero-variance groups,
   success per task type) and, every `checkpoint_every` iterations, a resumable checkpoint.

Every iteration's episodes are played by a worker (trainers.inflight.InFlight). Synchronous (the
default, `asynchronous.max_staleness: 0`), the trainer waits for them. Asynchronous (`max_staleness:
k`), the next iterations' tasks are dealt and their episodes played on snapshots of the weights
(rollout processes that the trainer helps once its update is done, a thread, or vLLM) while this
iteration prepares and updates, so each batch comes from a policy up to k versions behind the trainer;
the proximal policy (decoupled PPO's: the trainer's weights before the update) is interpolated from the
update's own forward passes (`proximal: loglinear`) or `prepare` recomputes its log-probs under those
weights (`recompute`), and tokens are weighted or masked by the importance ratio
(`asynchronous.correction`); or, with `correction: none`, PPO's ratio is taken against the behaviour
log-probs. Without a recomputation the mismatch is measured on the update's first minibatch (its
forward pass runs on the proximal weights). Checkpoints hold what is in flight (its tasks and weights), so
resume is exact in both modes.

The same loop runs on data-parallel DeepSpeed ZeRO-2 ranks (compute.backend: deepspeed; `rl_rank`) over
a training engine (trainers.engine): the rollouts are spread over the ranks (`compute.deepspeed.spread_rollouts`:
each rank plays its chunks of a synchronous round on its live weights, trainers.rank_rounds, and of an
asynchronous flight on a snapshot taken before its update, trainers.inflight), or rank 0 plays them
(vLLM, or spread off); rank 0 prepares, every rank gets the batch,
`update` gives each rank its share of every minibatch's rows with the same share weighting; the same
curve as one process to float rounding (tests/test_deepspeed.py). PPO (critic) and ZeRO-3 are refused
there (`check_ranks`).
"""

from __future__ import annotations

import contextlib
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from agentkiln.algos import registry
from agentkiln.algos.losses import aggregate, entropy_bonus, kl_penalty, loglinear_proximal
from agentkiln.config import RLParams
from agentkiln.envs import TaskSpec
from agentkiln.policy import lora, partial, save_policy
from agentkiln.policy.model import Policy, place
from agentkiln.rewards import RewardState, observe_iteration
from agentkiln.rollout.backends import HFRollout, SnapshotRollout, open_rollout
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode, own_episodes
from agentkiln.trainers import checkpoint, distributed, episode_log
from agentkiln.trainers.batch import Batch, build_batch, token_logprobs
from agentkiln.trainers.offline import OfflineFeed
from agentkiln.trainers.credit import advantages, shaped_turn_rewards
from agentkiln.trainers.select import Selector
from agentkiln.trainers.sampler import TaskSampler
from agentkiln.trainers.critic import Critic, value_loss
from agentkiln.trainers.engine import Engine, EngineFactory, local_factory
from agentkiln.trainers.inflight import InFlight, RankFlights, iteration_seed, play, tasks_per_chunk
from agentkiln.trainers.rank_rounds import RankRounds

def collect(policy: Policy, pool: list[TaskSpec], tasks_dir: Path, p: RLParams, rng: random.Random, seed: int,
            budget_left: int | None = None, rollout=None, sampler: TaskSampler | None = None,
            rewards: RewardState | None = None, played_first: list[Episode] | None = None
            ) -> tuple[list[Episode], list[Episode], dict]:
    """(episodes to train on: `tasks_per_iter` groups, with dynamic sampling only groups whose shaped
    rewards vary; every episode played, for the metrics; stats). Dynamic sampling stops playing
    more rounds once `budget_left` episodes were played. `rollout`: the backend (default: the
    in-process engine on `policy`); `sampler`: deals the tasks (default: uniform over `pool`);
    `played_first`: the first round's episodes, played already (asynchronous RL)."""
    rollout = rollout or HFRollout(policy)
    sampler = sampler or TaskSampler(pool)
    kept: list[Episode] = []
    everything: list[Episode] = []
    groups_seen = groups_flat = played = 0
    rounds = p.max_sample_rounds if p.dynamic_sampling else 1
    for r in range(rounds):
        if r == 0 and played_first is not None:
            episodes = played_first
        else:
            episodes = play(rollout, sampler.sample(p.tasks_per_iter, rng), tasks_dir, p, seed + r)
        played += len(episodes)
        everything += episodes
        scores = [sum(rs) for rs in shaped_turn_rewards(episodes, p, rewards)]
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
def score(policy: Policy, batch: Batch, temperature: float, rows_per_pass: int, base: bool = False) -> torch.Tensor:
    """Log-probs of the batch's reply tokens under `policy` (`base`: with its LoRA adapters off), as
    a [R, T] column on the CPU."""
    out = torch.zeros(batch.loss_mask.shape)
    off = lora.reference(policy) if base else contextlib.nullcontext()
    order = by_length(batch)  # passes of rows of like length pad little (as the update's micro-batches)
    with off, policy.autocast():
        for i in range(0, batch.rows, rows_per_pass):
            rows = order[i : i + rows_per_pass]
            sub = batch.select(rows)
            lp, _ = token_logprobs(policy.model, sub, temperature, with_entropy=False)
            col = torch.zeros(sub.loss_mask.shape)
            col[sub.loss_mask] = lp.float().cpu()
            out[rows, : col.shape[1]] = col
    return out


def mismatch_stats(delta: torch.Tensor) -> dict:
    """Mean |delta log p| and the k3 KL(behaviour || trainer) of tokens whose log-probs differ by `delta`
    (trainer minus behaviour); zeros for no tokens."""
    return {"mismatch/abs_logp_diff": float(delta.abs().mean()) if len(delta) else 0.0,
            "mismatch/k3_kl": float((delta.exp() - 1 - delta).mean()) if len(delta) else 0.0}


def rollout_mismatch(batch: Batch, trainer_logp: torch.Tensor, tis_cap: float | None, masked: bool = False
                     ) -> tuple[torch.Tensor, dict]:
    """Compare the rollout engine's log-probs (batch.old_logp) with the trainer's recomputation of the
    same tokens: (per-token truncated importance weight min(pi_trainer / pi_rollout, tis_cap), or ones
    without a cap; `masked`: 1 where the ratio is within [1 / tis_cap, tis_cap], else 0 (masked IS);
    health metrics: mean |delta log p|, max, and the k3 KL(rollout || trainer))."""
    rollout_lp, train_lp = batch.flat(batch.old_logp), batch.flat(trainer_logp)
    delta = train_lp - rollout_lp
    stats = mismatch_stats(delta) | {"mismatch/max_abs_logp_diff": float(delta.abs().max()) if len(delta) else 0.0}
    weight = torch.ones_like(delta)
    if tis_cap is not None and masked:
        keep = (delta.exp() <= tis_cap) & (delta.exp() >= 1 / tis_cap)
        weight = keep.float()
        stats["mismatch/masked_frac"] = float(1 - weight.mean()) if len(weight) else 0.0
    elif tis_cap is not None:
        weight = delta.exp().clamp(max=tis_cap)
        stats["mismatch/tis_weight_mean"] = float(weight.mean()) if len(weight) else 1.0
        stats["mismatch/tis_clipped_frac"] = float((delta.exp() > tis_cap).float().mean()) if len(delta) else 0.0
    return weight, stats


def bypassed(p: RLParams) -> bool:
    """Asynchronous with `correction: none`: no recomputation before the update (verl's bypass mode);
    PPO's ratio is taken against the behaviour log-probs, and the mismatch is measured on the update's
    first minibatch (`update`)."""
    return bool(p.asynchronous.max_staleness) and p.asynchronous.correction == "none"


def prepare(policy: Policy, ref: Policy | None, critic: Critic | None, episodes: list[Episode], p: RLParams,
            recompute: bool = False, rewards: RewardState | None = None, lags: dict[int, int] | None = None
            ) -> tuple[Batch, torch.Tensor | None, torch.Tensor | None, dict]:
    """The iteration's batch with its advantage (and reference log-prob) columns; the critic's values
    and targets per turn (PPO); mismatch stats. Rows whose tokens all have zero advantage carry no
    signal and are dropped (not with a critic: it still learns from them). `recompute`: the replies
    came from another engine, so PPO's old log-probs are the trainer's recomputation (verl's
    old_log_prob) and, with `tis_cap`, each token's advantage is scaled by its truncated importance
    weight (the same as weighting its loss: the clipped surrogate is linear in A for a weight > 0).
    Without a critic or `kl_in_reward` the rows are dropped first, so the recomputation, its mismatch
    statistics and the reference's log-probs cover the rows trained. `lags` (asynchronous, `proximal:
    loglinear`: optimizer steps from each policy version that played to the trainer's weights) replaces
    the recomputation: each row carries its episode's lag and `update` interpolates the proximal
    log-probs from its own forward passes."""
    batch = build_batch(episodes, policy.pad_id)
    micro = p.micro_batch_size or p.minibatch_size
    stats: dict = {}
    tis = trainer_logp = returns = None
    cap = p.tis_cap
    a = p.asynchronous
    # without a critic or a KL penalty in the reward the advantages need no log-probs: computed first,
    # the rows without any are dropped before the scoring passes below (about half a batch), which
    # then score only the rows trained
    early = critic is None and not p.kl_in_reward
    if early:
        batch.advantages, returns = advantages(batch, episodes, p, None, None, rewards)
        episode_log.annotate(batch, episodes)
        batch = with_signal(batch)
    if lags is not None and all(ep.policy_version in lags for ep in episodes):
        batch.lag = torch.tensor([lags[episodes[int(e)].policy_version] for e in batch.episode], dtype=torch.float32)
    elif recompute and not bypassed(p):
        trainer_logp = score(policy, batch, p.temperature, micro)
        if a.max_staleness:  # the behaviour policy lags the trainer: the chosen off-policy correction
            cap = a.is_cap
            tis, stats = rollout_mismatch(batch, trainer_logp, cap, masked=a.correction == "masked")
        else:
            tis, stats = rollout_mismatch(batch, trainer_logp, cap)
        batch.old_logp = trainer_logp  # the proximal policy: PPO's ratio is taken against it
    if p.kl_coef > 0 and (ref is not None or lora.has_lora(policy)):
        batch.ref_logp = score(ref or policy, batch, p.temperature, micro, base=ref is None)
    token_kl = None
    if p.kl_in_reward and batch.ref_logp is not None:
        token_kl = kl_penalty(batch.flat(batch.old_logp), batch.flat(batch.ref_logp), p.kl_estimator)
    if critic is not None:
        with policy.autocast():
            values = critic.values(batch, micro)
    else:
        values = None
    if not early:
        batch.advantages, returns = advantages(batch, episodes, p, token_kl, values, rewards)
    if tis is not None and cap is not None:
        batch.advantages[batch.loss_mask] = batch.flat(batch.advantages) * tis
    if not early or trainer_logp is not None:
        episode_log.annotate(batch, episodes, trainer_logp, kept_only=early)
    if critic is None and (not early or tis is not None):  # masked IS can leave a row without advantage
        batch = with_signal(batch)
    return batch, values, returns, stats


def with_signal(batch: Batch) -> Batch:
    """The rows with a nonzero advantage on some reply token: the others carry no signal."""
    signal = ((batch.advantages != 0) & batch.loss_mask).any(1)
    return batch.select(signal.nonzero().squeeze(-1))


def _seq_count(seq: torch.Tensor) -> int:
    return len(torch.unique(seq))


def by_length(batch: Batch) -> list[int]:
    """The batch's rows ordered by their episode's longest row, an episode's rows together: micro-batches
    cut from this order pad little (a 12-token FrozenLake row beside a 1,500-token cooking row wasted
    most of a micro-batch's compute). The minibatch's gradient does not depend on how it is cut."""
    length = batch.attention_mask.sum(1)
    longest: dict[int, int] = {}
    for r, e in enumerate(batch.episode.tolist()):
        longest[e] = max(longest.get(e, 0), int(length[r]))
    return sorted(range(batch.rows), key=lambda r: (longest[int(batch.episode[r])], int(batch.episode[r]), r))


def update(engine: Engine, policy: Policy, critic: Critic | None, batch: Batch, p: RLParams,
           critic_opt: torch.optim.Optimizer | None, gen: torch.Generator, values: torch.Tensor | None = None,
           returns: torch.Tensor | None = None) -> dict:
    """PPO epochs over shuffled minibatches of rows (every rank draws the same ones: same `gen`). Each
    rank takes its share of a minibatch's rows (`engine.share`: all of them on one process), cut into
    micro-batches where the engine accumulates gradients locally; each micro-batch's loss is weighted
    by its share of the minibatch's aggregation denominator (tokens for token-mean PPO, sequences
    otherwise; seq-mean-token-sum-norm's length is the constant `loss_agg_norm_len`) times the world,
    so the gradients add up to exactly the minibatch's. Then the engine clips by the global norm and
    steps. Stats per minibatch: share-weighted sums over micro-batches and ranks (the minibatch's own
    value of every token-mean quantity), averaged over minibatches; grad_norm before clipping. PPO
    also fits its critic (one process only: trainers.rl.check_ranks)."""
    stats: dict[str, list[float]] = defaultdict(list)
    micro_size = p.micro_batch_size or p.minibatch_size
    token_level = p.loss_agg == "token-mean" and registry.policy_loss(p.policy_loss).token_level  # share of tokens, else of sequences
    # no recomputation: the mismatch is measured on the update's first minibatch, whose forward pass runs
    # on the proximal weights (what a recomputation scores), before any step of this update moves them
    measure = bypassed(p) or batch.lag is not None
    steps = 0  # optimizer steps this update has taken (the loglinear proximal policy's v_theta - v_prox)
    engine.train()
    for epoch in range(p.ppo_epochs):
        order = torch.randperm(batch.rows, generator=gen).tolist()
        for i in range(0, len(order), p.minibatch_size):
            mb = batch.select(order[i : i + p.minibatch_size])
            n_tok, n_seq = mb.n_tokens, _seq_count(mb.seq_ids())
            engine.zero_grad()
            mine, active = engine.share(list(range(mb.rows)))
            part = mb if len(mine) == mb.rows else mb.select(mine)
            rows = by_length(part)
            size = micro_size if engine.micro_batching else part.rows
            acc: dict[str, float] = defaultdict(float)
            for k in range(0, part.rows, size):
                micro = part.select(rows[k : k + size])
                share = (micro.n_tokens / n_tok if token_level else _seq_count(micro.seq_ids()) / n_seq) if active else 0.0
                for key, v in _micro_loss(engine, policy, micro, p, share * engine.world, measure and steps == 0,
                                          steps).items():
                    acc[key] += v * share
            keys = sorted(acc)
            for key, v in zip(keys, engine.all_sum([acc[key] for key in keys])):
                stats[key].append(v)
            stats["grad_norm"].append(engine.step())
            steps += 1
            if critic is not None:
                critic.train()
                critic_opt.zero_grad(set_to_none=True)
                for k in range(0, mb.rows, micro_size):
                    micro = mb.select(list(range(k, min(k + micro_size, mb.rows)))).to(policy.device)
                    with policy.autocast():
                        turns, v = critic(micro)
                    turns = turns.cpu()
                    vl = value_loss(v, values[turns].to(v.device), returns[turns].to(v.device), p.value_clip)
                    (vl * micro.rows / mb.rows).backward()
                    stats["value_loss"].append(float(vl.detach()))
                torch.nn.utils.clip_grad_norm_(critic.parameters(), p.max_grad_norm)
                critic_opt.step()
    engine.eval()
    return {k: sum(v) / len(v) for k, v in stats.items() if v} | {"optimizer_steps": steps}


def _micro_loss(engine: Engine, policy: Policy, micro: Batch, p: RLParams, weight: float,
                mismatch: bool = False, steps: int = 0) -> dict:
    """Backpropagate one micro-batch's loss times `weight` (its share of the minibatch times the world)
    through the engine; return its stats (`mismatch`: also the behaviour / trainer mismatch of its
    tokens, the trainer's log-probs being this forward pass's: bypassed asynchronous RL, or the loglinear
    proximal policy, interpolated here after `steps` optimizer steps of this update and corrected for as
    `asynchronous.correction` says: decoupled weights each token's advantage by min(pi_prox / pi_b,
    is_cap), masked drops the tokens outside [1 / is_cap, is_cap]).

    loss = policy loss + kl_coef * agg(KL to the reference) (unless folded into the rewards)
           - entropy_coef * agg(token entropy), every term reduced by `loss_agg`."""
    micro = micro.to(policy.device)
    with policy.autocast():
        logp, entropy = engine.forward(token_logprobs, micro, p.temperature)
    behaviour, adv, seq = micro.flat(micro.old_logp), micro.flat(micro.advantages), micro.seq_ids()
    old, corr = behaviour, {}
    if micro.lag is not None:  # PPO's ratio against the interpolated proximal policy, its gap to the behaviour corrected
        old = loglinear_proximal(behaviour, logp, micro.lag[:, None].expand_as(micro.loss_mask)[micro.loss_mask], steps)
        w = (old - behaviour).float().exp()
        cap = p.asynchronous.is_cap
        w = ((w <= cap) & (w >= 1 / cap)).to(adv.dtype) if p.asynchronous.correction == "masked" else w.clamp(max=cap)
        adv = adv * w
        corr = {"mismatch/is_weight_mean": float(w.mean()) if len(w) else 1.0}
    norm_len = float(p.loss_agg_norm_len)
    pg, info = registry.policy_loss(p.policy_loss).fn(logp, old, adv, seq, p)
    loss = pg
    stats = {"pg_loss": float(pg.detach()), "clip_frac": info["clip_frac"], "ratio_mean": info["ratio_mean"]} | corr
    if micro.ref_logp is not None:
        kl = aggregate(kl_penalty(logp, micro.flat(micro.ref_logp), p.kl_estimator), p.loss_agg, seq, norm_len)
        stats["kl"] = float(kl.detach())
        if p.kl_coef > 0 and not p.kl_in_reward:
            loss = loss + p.kl_coef * kl
    ent = aggregate(entropy.detach(), p.loss_agg, seq, norm_len)
    if p.entropy_coef > 0:
        loss = loss + entropy_bonus(entropy, p.entropy_coef, p.loss_agg, seq, norm_len)
    if mismatch:  # every rank has the keys (their stats are summed over ranks)
        stats |= mismatch_stats(logp.detach().float() - behaviour.float())
    engine.backward(loss * weight)
    return stats | {"loss": float(loss.detach()), "entropy": float(ent.detach())}


def episode_metrics(episodes: list[Episode], batch: Batch | None) -> dict:
    """Health of one iteration: over every episode played (before dynamic sampling's filter); success
    over the policy's own episodes (those rollout guidance left alone), the guided ones apart."""
    turns = [t for ep in episodes for t in ep.turns]
    own = own_episodes(episodes)
    row = {
        "reward_mean": sum(ep.reward for ep in episodes) / len(episodes),
        "success": sum(ep.won for ep in own) / len(own),
        "turns_mean": len(turns) / len(episodes),
        "response_tokens": sum(t.n_tokens for t in turns) / max(1, len(turns)),
        "episode_tokens": sum(len(ep.ids) for ep in episodes) / len(episodes),
        "invalid_rate": sum(t.invalid for t in turns) / max(1, len(turns)),
        "truncated_rate": sum(ep.truncated for ep in episodes) / len(episodes),
        "windows_mean": sum(len(ep.windows) for ep in episodes) / len(episodes),
        "trained_tokens": batch.n_tokens if batch is not None else 0,
        "adv_abs_mean": float(batch.flat(batch.advantages).abs().mean()) if batch is not None and batch.n_tokens else 0.0,
    }
    guided = [ep for ep in episodes if ep.guide_at is not None]
    if guided:
        row |= {"guided/success": sum(ep.won for ep in guided) / len(guided),
                "guided/turn_share": sum(t.guided for t in turns) / max(1, len(turns))}
    by_type: dict[str, list[bool]] = defaultdict(list)
    for ep in own:
        by_type[ep.task_type or ep.family].append(ep.won)
    row |= {f"success/{k}": sum(v) / len(v) for k, v in sorted(by_type.items())}
    return row


def make_sampler(pool: list[TaskSpec], p: RLParams) -> TaskSampler:
    return TaskSampler(pool, p.sampling, p.mix, p.min_share, p.success_ema, p.replay_share)


def observe(sampler: TaskSampler, episodes: list[Episode]) -> None:
    """Tell the sampler how each task type and task fared this iteration (every episode played)."""
    won: dict[str, list[bool]] = defaultdict(list)
    by_task: dict[str, list[bool]] = defaultdict(list)
    for ep in own_episodes(episodes):
        won[ep.task_type or ep.family].append(ep.won)
        by_task[ep.task_id].append(ep.won)
    sampler.observe(won, by_task)


POOL_PROBE = 64  # tasks of the pool whose greedy success a stage reports before and after training


def greedy_success(policy: Policy, tasks: list[TaskSpec], tasks_dir: Path, p: RLParams, desc: str) -> float:
    """Greedy success on the first POOL_PROBE tasks of `tasks` (a split's order is its seeded shuffle of
    task types): the health check of a stage, not a score (the panels are that)."""
    tasks = tasks[:POOL_PROBE]
    agent = HFRollout(policy).agent(1.0, True, 0, p.rollout_batch, p.decoding, p.max_reply_tokens)
    eps = run_episodes(agent, tasks, tasks_dir, p.max_turns, progress=desc)
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
    rollout=None,
    log_episodes: Callable[[int, list[dict]], None] | None = None,
    make_engine: EngineFactory | None = None,
    spread: bool = False,
    select: Selector | None = None,
) -> list[dict]:
    """Train `policy` in place on `pool`; `ref` (the stage's starting policy; None with LoRA: the
    policy with its adapters off) stays frozen. `rollout`: the backend (rollout.backends; default the
    in-process engine), synced with the weights before every iteration's rollouts. With `ckpt_dir`,
    resumes from a checkpoint of the same run (`ckpt_key`) and writes new ones. `log_episodes(it,
    sample)` gets `p.log_episodes` of each iteration's trained episodes (trainers.episode_log; a
    checkpoint keeps them, and a resumed run hands them over again, as it logs the curve again). Returns
    per-iteration metrics.

    `make_engine`: the training engine (trainers.engine; default one process). On DeepSpeed ranks
    (trainers.distributed.RankFactory; every rank calls this, `rl_rank`) rank 0 plays the rollouts
    (the in-process engine on its whole ZeRO-2 copy of the weights, the same seeds as one process),
    prepares the batch and broadcasts it with the iteration's metrics; every rank trains on its share
    of each minibatch (`update`); rank 0 alone logs and writes checkpoints, which every rank resumes
    from. What ranks do not do is refused first (`check_ranks`). `spread` (the in-process engine):
    every rank plays its chunks of each synchronous round (trainers.rank_rounds) or asynchronous flight
    launched ahead (trainers.inflight.RankFlights) instead; on one process the same chunks and seeds,
    played by it alone."""
    with partial.top_layers(policy, p.top_layers):  # the layers this stage trains (the next starts as given)
        return _train_rl(policy, ref, pool, tasks_dir, p, seed, log, ckpt_dir, ckpt_key, rollout, log_episodes, select,
                         make_engine, spread)


def _train_rl(policy, ref, pool, tasks_dir, p, seed, log, ckpt_dir, ckpt_key, rollout, log_episodes, select,
              make_engine, spread) -> list[dict]:
    if ref is not None:
        ref.model.eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.trainable(), lr=p.lr, weight_decay=0.0)
    critic = critic_opt = None
    if registry.estimator(p.algorithm).needs_critic:
        critic = Critic(policy.model)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=0.0)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sampler = make_sampler(pool, p)
    rewards = RewardState(p, seed)  # adaptive success, process model, judge: updated every iteration
    history: list[dict] = []
    logged: list[tuple[int, list[dict]]] = []  # (iteration, its sample of episodes): what log_episodes got
    start = played = 0
    state = checkpoint.load(ckpt_dir, ckpt_key, rng, gen) if ckpt_dir else None  # every rank reads it
    if state is not None:
        policy.model.load_state_dict(state["policy"])  # before an engine shards anything
        sampler.load_state_dict(state["sampler"])
        rewards.load_state_dict(state["rewards"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
            critic_opt.load_state_dict(state["critic_opt"])
    engine = (make_engine or local_factory(policy.trainable(), log))(policy.model, opt, p.max_grad_norm)
    if state is not None:
        engine.load_optimizer_state(state["opt"])
        start, played, history = state["iteration"], state["played"], state["history"]
        if engine.main:
            print(f"rl: resumed from {ckpt_dir} after iteration {start}")
        for row in history:  # the new tracking run gets the whole curve
            engine.log({f"rl/{k}": v for k, v in row.items() if k != "iteration"}, row["iteration"])
        logged = state.get("episodes_logged") or []
        for it, sample in logged:  # and the episodes logged so far (DVC removed the stage's file)
            if log_episodes:
                log_episodes(it, sample)
        if select is not None and state.get("select"):
            select.load_state_dict(state["select"])
    total = p.iterations
    if p.episode_budget is not None and not p.dynamic_sampling:  # the budget, not iterations, ends the run
        total = min(total, -(-p.episode_budget // (min(p.tasks_per_iter, len(pool)) * p.group_size)))
    flight = offline = rounds = flights = None
    spread = spread and (rollout is None or type(rollout) is HFRollout)  # the in-process engine
    shares = spread and p.asynchronous.max_staleness and engine.world > 1  # flights shared with the other ranks
    if spread and not p.asynchronous.max_staleness:
        rounds = RankRounds(rollout or HFRollout(policy), engine, tasks_dir, p)  # each rank on its live weights
    elif spread and not engine.main:
        flights = RankFlights(policy, engine, tasks_dir, p)  # its chunks of the flights rank 0 launches
    if engine.main:  # the rollouts: rank 0 deals them (and plays them all unless spread)
        rollout = rounds or rollout or HFRollout(policy)
        if p.asynchronous.max_staleness and type(rollout) is HFRollout:
            rollout = SnapshotRollout(policy)  # the live weights change while the next rollouts play
        flight = InFlight(rollout, pool, tasks_dir, p, seed, rng, sampler, policy, ranks=engine if spread else None)
        if state is not None and state.get("in_flight"):
            flight.restore(state["in_flight"])
        offline = OfflineFeed(p.offline, policy) if p.offline.split else None
    if select is not None and not select.scores:
        select.observe(0, policy)  # the start: what every later look must not fall below, family by family
    try:
        for it in tqdm(range(start, p.iterations), desc="rl iterations", initial=start, total=total,
                       disable=engine.world > 1):
            if p.episode_budget is not None and played >= p.episode_budget:
                break
            payload = None
            if engine.main:
                payload, sample = _iteration(it, flight, policy, ref, critic, pool, tasks_dir, p, rng, seed, played,
                                             sampler, rewards, total, offline, _steps_at(history))
                if sample:
                    logged.append((it + 1, sample))
                    if log_episodes:
                        log_episodes(it + 1, sample)
                if rounds is not None:
                    payload[3]["rollout/ranks_playing"] = rounds.finish()
                elif spread:
                    payload[3]["rollout/ranks_playing"] = flight.ranks_playing
                payload = (*payload, flight.plans())  # spread flights: the other ranks' chunks of them
            elif rounds is not None:
                rounds.serve()  # this rank's chunks of every round rank 0 deals
            elif flights is not None:
                flights.hand_over(it)  # its chunks of the flight rank 0 takes now
            batch, values, returns, row, plans = engine.broadcast(payload)  # one process: the same objects
            played = row["episodes"]
            if flights is not None:
                flights.receive(plans)  # snapshot: the weights before this update, those rank 0 launched on
            if batch is not None and batch.rows:
                row |= update(engine, policy, critic, batch, p, critic_opt, gen, values, returns)
            if shares:  # every rank's update is done: rank 0 shares out the next flight's unclaimed chunks
                share = engine.broadcast(flight.share_out(it + 1) if engine.main else None)
                if flights is not None:
                    flights.play(share)
            if p.asynchronous.max_staleness and "mismatch/k3_kl" in row:
                row["mismatch/alarm"] = float(row["mismatch/k3_kl"] > p.asynchronous.kl_alarm)
                if row["mismatch/alarm"] and engine.main:
                    print(f"rl: iteration {it + 1}: KL(behaviour || trainer) {row['mismatch/k3_kl']:.4f} is above "
                          f"asynchronous.kl_alarm {p.asynchronous.kl_alarm}: the stale rollouts drift from the trainer")
            if select is not None and (select.due(it + 1) or it + 1 == total):
                row |= select.observe(it + 1, policy)
            history.append(row)
            engine.log({f"rl/{k}": v for k, v in row.items() if k != "iteration"}, it + 1)
            if ckpt_dir and p.checkpoint_every and (it + 1) % p.checkpoint_every == 0:
                shards, weights = engine.optimizer_state(), engine.weights()  # every rank takes part
                if engine.main:
                    checkpoint.save(ckpt_dir, ckpt_key, {
                        "policy": weights, "opt": shards, "iteration": it + 1, "played": played,
                        "history": history, "critic": critic.state_dict() if critic else None,
                        "critic_opt": critic_opt.state_dict() if critic_opt else None,
                        "sampler": sampler.state_dict(), "rewards": rewards.state_dict(),
                        "in_flight": flight.state(), "episodes_logged": logged,
                        "select": select.state_dict() if select is not None else None}, rng, gen)
        if select is not None and history and history[-1]["iteration"] not in select.scores:  # ended before `total`
            history[-1] |= select.observe(history[-1]["iteration"], policy)
            engine.log({f"rl/{k}": v for k, v in history[-1].items() if k.startswith("select/")},
                       history[-1]["iteration"])
    finally:
        if flight is not None:
            flight.close()
    engine.eval()
    if select is not None:
        select.restore(policy)  # the kept weights, not the last
    return history


def _steps_at(history: list[dict]) -> list[int]:
    """The optimizer steps taken before each iteration's update: the trainer's version in steps."""
    out = [0]
    for row in history:
        out.append(out[-1] + int(row.get("optimizer_steps", 0)))
    return out


def loglinear_lags(p: RLParams, rollout, it: int, steps_at: list[int]) -> dict[int, int] | None:
    """For `proximal: loglinear`, the optimizer steps from each policy version that may have played
    iteration `it` to the trainer's weights; None where the proximal log-probs are recomputed: synchronous,
    `correction: none` (no proximal policy), vLLM (its log-probs come from other kernels)."""
    a = p.asynchronous
    if not a.max_staleness or a.correction == "none" or a.proximal != "loglinear" or type(rollout) is not SnapshotRollout:
        return None
    return {v: steps_at[it] - steps_at[v] for v in range(max(0, it - a.max_staleness), it + 1)}


def _iteration(it: int, flight: InFlight, policy: Policy, ref: Policy | None, critic: Critic | None,
               pool: list[TaskSpec], tasks_dir: Path, p: RLParams, rng: random.Random, seed: int, played: int,
               sampler: TaskSampler, rewards: RewardState, total: int, offline: OfflineFeed | None = None,
               steps_at: list[int] | None = None) -> tuple[tuple, list[dict]]:
    """Rank 0's part of iteration `it`: its episodes (from the flight, within the staleness bound; with
    `offline`, a collected split's next episodes beside them), their batch with advantages and the
    iteration's metrics row (batch, values, returns, row: what every rank gets), and the sample of its
    episodes to log."""
    rollout = flight.rollout
    first, version = flight.take(it, last=total - 1)
    episodes, everything, info = collect(policy, pool, tasks_dir, p, rng, iteration_seed(seed, it),
                                         None if p.episode_budget is None else p.episode_budget - played,
                                         rollout, sampler, rewards, played_first=first)
    staleness = it - version  # policy versions between the weights that played and the trainer's
    if not 0 <= staleness <= p.asynchronous.max_staleness:
        raise RuntimeError(f"rl: iteration {it + 1} got episodes {staleness} versions stale "
                           f"(asynchronous.max_staleness {p.asynchronous.max_staleness})")
    for ep in everything:
        ep.policy_version = version
    observe(sampler, everything)
    reward_row = observe_iteration(rewards, everything, p.reward)
    played += info["episodes_played"]
    batch = values = returns = None
    mismatch: dict = {}
    extra = offline.take(it) if offline is not None else []
    if extra:  # trained on, not observed: the sampler and reward state track the pool's tasks
        episodes = episodes + extra
        info = info | {"offline/episodes": len(extra), "offline/success": sum(e.won for e in extra) / len(extra)}
    # a harness's offline episodes have no policy version: with them the proximal policy is recomputed
    lags = None if extra or steps_at is None else loglinear_lags(p, rollout, it, steps_at)
    if episodes:
        batch, values, returns, mismatch = prepare(policy, ref, critic, episodes, p, rollout.recompute, rewards, lags)
    row = {"iteration": it + 1, "episodes": played, **info, **episode_metrics(everything, batch), **mismatch,
           **reward_row, "async/staleness": staleness}
    sample = episode_log.sample(episodes, p.log_episodes, p.temperature) if p.log_episodes and episodes else []
    return (batch, values, returns, row), sample


# --------------------------------------------------------------------------- DeepSpeed ranks
def check_ranks(p: RLParams, compute) -> None:
    """What RL on DeepSpeed ranks does not do (yet), refused by name before any work."""
    if registry.estimator(p.algorithm).needs_critic:
        free = ", ".join(n for n in registry.estimator_names() if not registry.estimator(n).needs_critic)
        raise ValueError(f"rl: algorithm = {p.algorithm} with compute.backend = deepspeed: the critic is not trained "
                         f"on ranks; use a critic-free algorithm ({free}) or backend single")
    if p.select.panel is not None:
        raise ValueError(f"rl: select.panel = {p.select.panel!r} with compute.backend = deepspeed: the panel is played "
                         "on one process's weights, not on ranks (yet); set select.panel: null")
    if compute.deepspeed.zero_stage == 3:
        raise ValueError("rl: compute.deepspeed.zero_stage = 3 with compute.backend = deepspeed: the ranks play the "
                         "rollouts on their own whole copies of the weights, which ZeRO-3 shards; use zero_stage 2")


def spreads(p: RLParams, compute) -> bool:
    """Whether every rank plays its chunks of the rollouts on the in-process engine: of each synchronous
    round (trainers.rank_rounds), of each asynchronous flight launched ahead with rollout processes
    (`worker: process`; trainers.inflight); a vLLM engine's rollouts stay rank 0's."""
    return compute.deepspeed.spread_rollouts and compute.rollout.backend == "hf" and (
        not p.asynchronous.max_staleness or p.asynchronous.worker == "process")


def rl_rank(rank, job: dict) -> dict | None:
    """One DeepSpeed rank of an RL stage (the job: policy, ref, pool, tasks_dir, p, seed, out_dir,
    ckpt_dir, ckpt_key; stages.rl builds it): train its share; rank 0 then measures the pool's greedy
    success, saves the model (LoRA merged and checked, as on one process) from a fresh unsharded copy
    of the starting policy loaded with the final weights, and returns the history and its numbers."""
    policy = place(job["policy"], rank.compute)
    ref = place(job["ref"], rank.compute) if job["ref"] is not None else None
    p = job["p"]
    check_ranks(p, rank.compute)
    factory = distributed.RankFactory(rank)
    spread = spreads(p, rank.compute)
    if rank.main and rank.world > 1:
        chunks = -(-p.tasks_per_iter // tasks_per_chunk(p, snapshot=bool(p.asynchronous.max_staleness)))
        idle = "" if chunks >= rank.world else (
            f"; {rank.world - chunks} rank(s) idle: rl.rollout_batch "
            f"{max(p.group_size, p.tasks_per_iter * p.group_size // rank.world)} gives every rank a chunk")
        if not spread:
            print("rl: rank 0 plays the rollouts (" + (
                "compute.deepspeed.spread_rollouts is off" if not rank.compute.deepspeed.spread_rollouts else
                "on the vLLM engine" if rank.compute.rollout.backend != "hf" else
                f"asynchronous.worker {p.asynchronous.worker}: ranks share flights with worker process") + ")")
        elif p.asynchronous.max_staleness:
            print(f"rl: the other ranks play a share of each flight's {chunks} chunk(s) of "
                  f"rl.asynchronous.chunk_episodes {p.asynchronous.chunk_episodes} episodes, the part rank 0's "
                  "rollout processes have not claimed when the update is done")
        else:
            print(f"rl: every rank plays its chunks of each round ({chunks} chunk(s) of rl.rollout_batch "
                  f"{p.rollout_batch} episodes over {rank.world} ranks{idle})")
    # rank 0 deals every rollout and plays them on the backend compute.rollout names (vLLM: its engine,
    # synced from rank 0), or, spread, every rank plays its chunks on its own weights
    backend = open_rollout(policy, rank.compute, seed=job["seed"], lora=p.lora.enabled) if rank.main \
        else contextlib.nullcontext()
    with backend as rollout:
        history = train_rl(policy, ref, job["pool"], job["tasks_dir"], p, job["seed"], ckpt_dir=job["ckpt_dir"],
                           ckpt_key=job["ckpt_key"], rollout=rollout, make_engine=factory, spread=spread)
    weights = factory.engine.weights()  # every rank takes part
    if not rank.main:
        return None
    # the pool's greedy success on the trained copy (this rank's device), as one process measures it
    after = greedy_success(policy, job["pool"], job["tasks_dir"], p, job["desc"])
    final = rank.job()["policy"]
    final.model.load_state_dict(weights)
    final.model.eval()
    merged = lora.merge(final, job["out_dir"]) if lora.has_lora(final) else None
    save_policy(final, job["out_dir"])
    return {"history": history, "after": after, "merged": merged}
