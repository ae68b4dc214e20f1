"""Supervised training on whole episodes: the SFT cold start and trajectory distillation.

One row per episode window (trainers.batch): the loss is the mean negative log-likelihood of the
reply tokens (each action and its end-of-turn token); system, goal and observation tokens, and the
replies of turns flagged `mistake` (recovery demonstrations), are context, never targets. Minibatches group episodes of similar length (less padding), in a seeded order.

With a checkpoint directory, every epoch ends with a resumable checkpoint (weights, optimizer and
schedule, the minibatch order's generator, the process RNGs, the history): a run killed mid-way and
started again with the same inputs continues after its last finished epoch and ends with the very
weights an uninterrupted run ends with.

One loop for one process and for data-parallel DeepSpeed ranks (compute.backend: deepspeed;
trainers.distributed launches them, each calls this loop with its engine: trainers.engine): the same
minibatches on every rank, each rank the rows of its share, the same per-epoch loss curve to float
rounding (tests/test_deepspeed.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from agentkiln.policy.model import Policy
from agentkiln.rollout.episode import Episode
from agentkiln.trainers import checkpoint
from agentkiln.trainers.batch import Batch, build_batch, token_logprobs
from agentkiln.trainers.engine import EngineFactory, local_factory


@dataclass(frozen=True)
class OptimConfig:
    epochs: int
    batch_size: int  # episodes per optimizer step
    lr: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float


def warmup_cosine(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def length_grouped(lengths: list[int], batch_size: int, gen: torch.Generator, span: int = 8) -> list[list[int]]:
    """Seeded minibatches of row indices: a random order, sorted by length within windows of
    `span` minibatches (rows of a minibatch have similar lengths), minibatches in random order."""
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches = []
    for i in range(0, len(order), batch_size * span):
        chunk = sorted(order[i : i + batch_size * span], key=lambda r: lengths[r])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def sft_batch(policy: Policy, episodes: list[Episode]) -> Batch:
    """The rows to imitate: every reply token but those of mistake turns (a recovery episode's injected
    wrong actions stay in the conversation as context and get no loss: STeP's partial masking), scored
    over the whole vocabulary."""
    batch = build_batch(episodes, policy.pad_id, keep_turn=lambda e, k: not episodes[e].turns[k].mistake)
    batch.allowed = batch.allowed[..., :0]  # imitation: the whole vocabulary (no decoding masks)
    return batch


def train_supervised(
    policy: Policy,
    episodes: list[Episode],
    cfg: OptimConfig,
    seed: int,
    log: Callable[[dict, int], None] | None = None,
    desc: str = "sft",
    ckpt_dir: Path | None = None,
    ckpt_key: str = "",
    make_engine: EngineFactory | None = None,
    stop_after: int | None = None,
) -> list[dict]:
    """Train in place on `episodes` (with ids: rollout.sequence.render); per-epoch metrics. With
    `ckpt_dir`, resumes from a checkpoint of the same run (`ckpt_key`) and writes one per epoch.
    `stop_after`: return after that many epochs of the `cfg.epochs` schedule (a later call with the same
    checkpoint goes on from there, as a run never stopped would: the distill stage's restarts).

    `make_engine`: the engine (default one process; trainers.distributed.RankFactory on a rank, where
    every rank calls this). Every minibatch: each rank's loss (the summed NLL of its rows' reply tokens)
    is scaled by world / the minibatch's reply tokens, so the gradient is the token-mean gradient of the
    whole minibatch; then global-norm clipping, AdamW and the warmup-cosine schedule. Rank 0 alone logs
    and writes checkpoints (full weights, the optimizer state: every rank's shard on ranks)."""
    batch = sft_batch(policy, episodes)
    if not batch.rows:
        raise ValueError(f"{desc}: no training episodes")
    gen = torch.Generator().manual_seed(seed)
    state = checkpoint.load(ckpt_dir, ckpt_key, gen=gen) if ckpt_dir else None  # every rank reads it
    if state is not None:
        policy.model.load_state_dict(state["model"])  # before ZeRO-3 shards the weights
    opt = torch.optim.AdamW(policy.trainable(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(batch.rows / cfg.batch_size)
    # on the client optimizer: ZeRO keeps its param_group dicts, so the schedule's lr reaches AdamW
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.epochs * steps_per_epoch)
    engine = (make_engine or local_factory(policy.trainable(), log))(policy.model, opt, cfg.max_grad_norm)
    lengths = batch.attention_mask.sum(1).tolist()
    history, start = [], 0
    if state is not None:
        engine.load_optimizer_state(state["opt"])
        sched.load_state_dict(state["sched"])
        start, history = state["done"], state["history"]
        if engine.main:
            print(f"{desc}: resumed from {ckpt_dir} after epoch {start}")
        for row in history:  # the new tracking run gets the history again
            engine.log({f"{desc}/{k}": v for k, v in row.items() if k != "epoch"}, row["epoch"])
    for epoch in range(start, min(cfg.epochs, stop_after or cfg.epochs)):
        engine.train()
        nll, tot_tok, correct = 0.0, 0, 0
        bar = tqdm(length_grouped(lengths, cfg.batch_size, gen), desc=f"{desc} epoch {epoch + 1}/{cfg.epochs}",
                   leave=False, disable=engine.world > 1)
        for rows in bar:
            mine, active = engine.share(rows)
            n = int(batch.loss_mask[rows].sum())
            with policy.autocast():
                logp, _ = engine.forward(token_logprobs, batch.select(mine), with_entropy=False)
            loss = -logp.sum() / n  # the minibatch's token mean (this rank's part of it)
            engine.zero_grad()
            engine.backward(loss * engine.world if active else loss * 0.0)
            engine.step()
            sched.step()
            if active:
                nll -= float(logp.detach().double().sum())
                correct += int((logp > math.log(0.5)).sum())  # the argmax for sure when p > 0.5
            tot_tok += n
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        nll, correct = engine.all_sum([nll, float(correct)])
        row = {"epoch": epoch + 1, "loss": nll / tot_tok, "token_acc": correct / tot_tok, "lr": sched.get_last_lr()[0]}
        history.append(row)
        engine.log({f"{desc}/{k}": v for k, v in row.items() if k != "epoch"}, epoch + 1)
        if ckpt_dir:
            shards, weights = engine.optimizer_state(), engine.weights()  # every rank takes part
            if engine.main:
                checkpoint.save(ckpt_dir, ckpt_key, {"model": weights, "opt": shards, "sched": sched.state_dict(),
                                                     "done": epoch + 1, "history": history}, gen=gen)
    engine.eval()
    return history


def resume(state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, ckpt_dir: Path, desc: str,
           unit: str, log: Callable[[dict, int], None] | None) -> tuple[int, list[dict]]:
    """Load a checkpoint's model / optimizer / schedule state; (units done, history so far). The new
    tracking run gets the history logged again, as RL does on resume."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if sched is not None:
        sched.load_state_dict(state["sched"])
    done, history = state["done"], state["history"]
    print(f"{desc}: resumed from {ckpt_dir} after {unit} {done}")
    if log:
        for row in history:
            log({f"{desc}/{k}": v for k, v in row.items() if k not in ("epoch", "round")}, row.get(unit, 0))
    return done, history
