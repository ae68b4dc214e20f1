"""Token-level distillation: the student matches the teacher's next-token distributions.

- `forward_kl_loss`: KL(teacher || student) (Hinton-style knowledge distillation); trained on the
  teacher's own episodes by `train_forward_kl` (off-policy: mass-covering).
- `reverse_kl_loss`: KL(student || teacher) (GKD / on-policy distillation); trained by
  `train_on_policy` on episodes the student itself samples, every generated token scored by the
  teacher given exactly the same prompt ids (mode-seeking; no exposure bias).

Both compare full distributions at every reply (action) token position; prompt and observation
tokens are inputs only (zero weight). Both need the teacher's tokenizer (`shared_vocab`):
distillation into another tokenizer is `trajectory` mode (agentkiln.trainers.supervised).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from agentkiln.config import DistillParams
from agentkiln.envs import TaskSpec
from agentkiln.policy.model import MAX_ACTION_TOKENS, Policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import Episode, run_episodes
from agentkiln.trainers.batch import Sample, TokenBatch, make_batch
from agentkiln.trainers.supervised import OptimConfig, warmup_cosine

TEACHER_CACHE_BYTES = 1 << 30  # forward-kl caches the teacher's reply logits below this size, else rescores


# --------------------------------------------------------------------------- losses (pure)
def _log_probs(logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None) -> torch.Tensor:
    """log softmax(logits / T), renormalised over `allowed` when given; 0 (not -inf) outside it, so
    that p * log p terms there are exactly 0 and gradients stay finite."""
    z = logits.float() / temperature
    if allowed is None:
        return z.log_softmax(-1)
    return z.masked_fill(~allowed, float("-inf")).log_softmax(-1).masked_fill(~allowed, 0.0)


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
             allowed: torch.Tensor | None = None, reverse: bool = False) -> torch.Tensor:
    """Per-position KL over the last (vocabulary) dimension: [..., V] -> [...].
    Forward: sum_v p_t(v) (log p_t(v) - log p_s(v)); reverse: sum_v p_s(v) (log p_s(v) - log p_t(v)).
    The teacher is a constant (detached): gradients reach the student only."""
    log_s = _log_probs(student_logits, temperature, allowed)
    log_t = _log_probs(teacher_logits.detach(), temperature, allowed)
    if reverse:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def _token_mean(per_pos: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    w = mask.to(per_pos.dtype)
    return temperature**2 * (per_pos * w).sum() / w.sum().clamp(min=1e-8)


def forward_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                    temperature: float = 1.0, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """T^2 * token-mean of KL(teacher || student) at temperature T. `mask` ([...], bool or weights)
    is 1 at reply-token positions and 0 at prompt / padding positions; `allowed` ([..., V] bool)
    restricts both distributions to the tokens constrained decoding allowed there."""
    return _token_mean(token_kl(student_logits, teacher_logits, temperature, allowed), mask, temperature)


def reverse_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                    temperature: float = 1.0, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """T^2 * token-mean of KL(student || teacher) at temperature T (arguments as `forward_kl_loss`)."""
    return _token_mean(token_kl(student_logits, teacher_logits, temperature, allowed, reverse=True), mask, temperature)


# --------------------------------------------------------------------------- shared tokenizer
def shared_vocab(teacher: Policy, student: Policy, mode: str) -> int:
    """The size V of the vocabulary the two policies share, or a ValueError: token-level KL compares
    distributions over the same token ids."""
    vt, vs = teacher.tokenizer.get_vocab(), student.tokenizer.get_vocab()
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    same_specials = all(getattr(teacher.tokenizer, a) == getattr(student.tokenizer, a) for a in specials)
    if vt != vs or not same_specials:
        how = "different tokens or ids" if len(vt) == len(vs) else "different sizes"
        raise ValueError(
            f"distill.mode {mode}: the student's tokenizer differs from the teacher's (teacher vocabulary "
            f"{len(vt)} tokens, student vocabulary {len(vs)} tokens: {how}); token-level distillation compares "
            "distributions over the same token ids: use distill.mode: trajectory (it re-tokenizes the teacher's "
            "actions) or a student with the teacher's tokenizer")
    vocab = len(teacher.tokenizer)
    for name, pol in (("teacher", teacher), ("student", student)):
        rows = pol.model.get_input_embeddings().num_embeddings
        if rows < vocab:
            raise ValueError(f"distill.mode {mode}: the {name} model has {rows} token embeddings, fewer than its "
                             f"tokenizer's {vocab} tokens")
    return vocab


# --------------------------------------------------------------------------- samples and scores
def turn_samples(episodes: list[Episode]) -> list[Sample]:
    """Every turn as its exact ids: the prompt the policy saw, the tokens it generated and the
    constrained-decoding masks; nothing is re-tokenized."""
    return [Sample(t.gen.prompt_ids, t.gen.ids, t.gen.allowed) for ep in episodes for t in ep.turns]


def fit_context(policy: Policy, sample: Sample) -> Sample:
    """Left-truncate the prompt (keeping BOS) as `policy.encode_prompt` would, for a student whose
    context is shorter than the teacher's."""
    bos = policy.tokenizer.bos_token_id
    budget = policy.max_context - MAX_ACTION_TOKENS - (bos is not None)
    ids = sample.prompt_ids
    head, body = (ids[:1], ids[1:]) if bos is not None and ids[:1] == [bos] else ([], ids)
    if len(body) <= budget:
        return sample
    return Sample(head + body[-budget:], sample.reply_ids, sample.allowed)


def reply_logits(model: torch.nn.Module, batch: TokenBatch, vocab: int) -> torch.Tensor:
    """[N, V] float logits at the positions that predict each reply token (TokenBatch rows/cols)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return logits[batch.rows, batch.cols, :vocab].float()


@torch.no_grad()
def teacher_reply_logits(teacher: Policy, samples: list[Sample], vocab: int, batch_size: int = 32
                         ) -> list[torch.Tensor]:
    """The teacher's logits at every reply position, one [len(reply), V] tensor per sample."""
    teacher.model.eval()
    out: list[torch.Tensor] = []
    for i in range(0, len(samples), batch_size):
        chunk = [Sample(s.prompt_ids, s.reply_ids) for s in samples[i : i + batch_size]]
        flat = reply_logits(teacher.model, make_batch(chunk, teacher.pad_id, vocab), vocab)
        out += list(flat.split([len(s.reply_ids) for s in chunk]))
    return out


@dataclass(frozen=True)
class KDConfig:
    temperature: float = 1.0
    support: str = "vocabulary"  # or "admissible": both distributions renormalised over the allowed tokens


TeacherScores = Callable[[list[int], TokenBatch], torch.Tensor]  # (sample indices, their batch) -> [N, V]


def _kd_pass(student: Policy, samples: list[Sample], teacher_scores: TeacherScores, loss_fn, kd: KDConfig,
             opt: torch.optim.Optimizer, sched, gen: torch.Generator, batch_size: int, max_grad_norm: float,
             vocab: int, desc: str) -> dict:
    """One shuffled pass over `samples`, one optimizer step per `batch_size` turns; token-mean loss."""
    model = student.model
    model.train()
    admissible = kd.support == "admissible"
    order = torch.randperm(len(samples), generator=gen).tolist()
    tot_loss, tot_tok, teacher_lp, norms = 0.0, 0, 0.0, []
    bar = tqdm(range(0, len(order), batch_size), desc=desc, leave=False)
    for i in bar:
        idx = order[i : i + batch_size]
        chunk = [samples[j] if admissible else Sample(samples[j].prompt_ids, samples[j].reply_ids) for j in idx]
        batch = make_batch(chunk, student.pad_id, vocab)
        s_logits = reply_logits(model, batch, vocab)
        t_logits = teacher_scores(idx, batch)
        mask = torch.ones(batch.targets.shape[0])  # only reply positions were gathered: all weigh 1
        loss = loss_fn(s_logits, t_logits, mask, kd.temperature, batch.allowed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        if sched is not None:
            sched.step()
        n = batch.targets.numel()
        tot_loss += loss.item() * n
        tot_tok += n
        teacher_lp += float(_log_probs(t_logits, 1.0, batch.allowed).gather(-1, batch.targets[:, None]).sum())
        bar.set_postfix(loss=f"{loss.item():.4f}")
    model.eval()
    return {"loss": tot_loss / tot_tok, "teacher_logprob": teacher_lp / tot_tok,
            "grad_norm": sum(norms) / len(norms), "tokens": tot_tok, "steps": len(norms)}


# --------------------------------------------------------------------------- forward KL (off-policy)
def train_forward_kl(student: Policy, teacher: Policy, samples: list[Sample], cfg: OptimConfig, kd: KDConfig,
                     seed: int, log: Callable[[dict, int], None] | None = None, desc: str = "distill") -> list[dict]:
    """Train `student` in place to minimise KL(teacher || student) on `samples` (the teacher's turns:
    exact prompt and generated ids). Returns per-epoch metrics. The teacher's logits are computed once
    (cached; rescored per batch when the cache would exceed TEACHER_CACHE_BYTES)."""
    if not samples:
        raise ValueError(f"{desc}: no training samples (no teacher episode was kept)")
    vocab = shared_vocab(teacher, student, "forward-kl")
    teacher.model.eval().requires_grad_(False)
    samples = [fit_context(student, s) for s in samples]
    n_tokens = sum(len(s.reply_ids) for s in samples)
    if n_tokens * vocab * 4 <= TEACHER_CACHE_BYTES:
        cache = teacher_reply_logits(teacher, samples, vocab)

        def scores(idx, batch):
            return torch.cat([cache[j] for j in idx])
    else:
        def scores(idx, batch):
            with torch.no_grad():
                return reply_logits(teacher.model, batch, vocab)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(student.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.epochs * math.ceil(len(samples) / cfg.batch_size))
    history = []
    for epoch in range(cfg.epochs):
        stats = _kd_pass(student, samples, scores, forward_kl_loss, kd, opt, sched, gen, cfg.batch_size,
                         cfg.max_grad_norm, vocab, f"{desc} forward-kl epoch {epoch + 1}/{cfg.epochs}")
        row = {"epoch": epoch + 1, **stats, "lr": sched.get_last_lr()[0]}
        history.append(row)
        if log:
            log({f"{desc}/{k}": v for k, v in row.items() if k != "epoch"}, epoch + 1)
    return history


# --------------------------------------------------------------------------- reverse KL (on-policy, GKD)
def train_on_policy(student: Policy, teacher: Policy, pool: list[TaskSpec], tasks_dir, p: DistillParams, seed: int,
                    log: Callable[[dict, int], None] | None = None, desc: str = "distill") -> list[dict]:
    """`p.iterations` rounds: the student plays `p.samples_per_task` episodes of each of `p.tasks_per_iter`
    tasks at `p.temperature`; the teacher scores every generated token given the same prompt ids;
    one pass of KL(student || teacher) over the round's turns (constant lr `p.onpolicy_lr or p.lr`).
    Returns per-round metrics (the student's sampled success included)."""
    vocab = shared_vocab(teacher, student, "on-policy")
    teacher.model.eval().requires_grad_(False)
    kd = KDConfig(p.kd_temperature, p.kd_support)
    opt = torch.optim.AdamW(student.model.parameters(), lr=p.onpolicy_lr or p.lr, weight_decay=p.weight_decay)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def scores(idx, batch):
        return reply_logits(teacher.model, batch, vocab)

    history = []
    for it in tqdm(range(p.iterations), desc=f"{desc} on-policy rounds"):
        tasks = rng.sample(pool, min(p.tasks_per_iter, len(pool)))
        agent = PolicyAgent(student, temperature=p.temperature, seed=seed * 100_003 + it * 101 + 1)
        episodes = run_episodes(agent, tasks, tasks_dir, p.max_turns, group_size=p.samples_per_task)
        samples = turn_samples(episodes)
        stats = _kd_pass(student, samples, scores, reverse_kl_loss, kd, opt, None, gen, p.batch_size,
                         p.max_grad_norm, vocab, f"{desc} on-policy round {it + 1}/{p.iterations}")
        row = {"round": it + 1, "episodes": len(episodes), "turns": len(samples),
               "success": sum(e.won for e in episodes) / len(episodes),
               "reward_mean": sum(e.reward for e in episodes) / len(episodes), **stats}
        history.append(row)
        if log:
            log({f"{desc}/onpolicy/{k}": v for k, v in row.items() if k != "round"}, it + 1)
    return history
