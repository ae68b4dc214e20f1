"""Supervised training on (state, action) pairs: the SFT cold start and trajectory distillation.

Loss = mean negative log-likelihood of the reply (action + EOS) tokens only; prompt tokens are
context, never targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from agentkiln.policy.model import Policy
from agentkiln.policy.prompt import build_prompt
from agentkiln.rollout.agents import AgentState
from agentkiln.trainers.batch import Sample, make_batch, reply_logprobs


@dataclass(frozen=True)
class OptimConfig:
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float


def samples_from_states(policy: Policy, pairs: Iterable[tuple[AgentState, str]]) -> list[Sample]:
    """Render each (state, action) with the policy's own prompt format and tokenizer."""
    out = []
    for state, action in pairs:
        text = build_prompt(policy.fmt, state.goal, state.past_actions, state.observation, state.admissible)
        out.append(Sample(policy.encode_prompt(text), policy.encode_action(action)))
    return out


def warmup_cosine(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_supervised(
    policy: Policy,
    samples: list[Sample],
    cfg: OptimConfig,
    seed: int,
    log: Callable[[dict, int], None] | None = None,
    desc: str = "sft",
) -> list[dict]:
    """Train in place; returns per-epoch metrics (loss, token accuracy)."""
    if not samples:
        raise ValueError(f"{desc}: no training samples")
    model = policy.model
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(samples) / cfg.batch_size)
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.epochs * steps_per_epoch)
    vocab = model.get_input_embeddings().num_embeddings
    history, step = [], 0
    for epoch in range(cfg.epochs):
        model.train()
        order = torch.randperm(len(samples), generator=gen).tolist()
        tot_loss, tot_tok, correct = 0.0, 0, 0
        bar = tqdm(range(0, len(samples), cfg.batch_size), desc=f"{desc} epoch {epoch + 1}/{cfg.epochs}", leave=False)
        for i in bar:
            batch = make_batch([samples[j] for j in order[i : i + cfg.batch_size]], policy.pad_id, vocab)
            logp, _ = reply_logprobs(model, batch)
            loss = -logp.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            n = logp.numel()
            tot_loss += loss.item() * n
            tot_tok += n
            correct += int((logp > math.log(0.5)).sum())  # the argmax for sure when p > 0.5
            bar.set_postfix(loss=f"{loss.item():.3f}")
        row = {"epoch": epoch + 1, "loss": tot_loss / tot_tok, "token_acc": correct / tot_tok, "lr": sched.get_last_lr()[0]}
        history.append(row)
        if log:
            log({f"{desc}/{k}": v for k, v in row.items() if k != "epoch"}, epoch + 1)
    model.eval()
    return history
