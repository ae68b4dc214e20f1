"""Token-level distillation: the student matches the teacher's next-token distributions.

- `forward_kl_loss`: KL(teacher || student) (Hinton-style knowledge distillation); trained on the
  teacher's own episodes by `train_forward_kl` (off-policy: mass-covering).
- `reverse_kl_loss`: KL(student || teacher) (GKD / on-policy distillation); trained by
  `train_on_policy` on episodes the student itself samples, every generated token scored by the
  teacher given exactly the same prompt ids (mode-seeking; no exposure bias).

Both compare full distributions at every reply token of whole episodes (one row per episode window,
trainers.batch); system, goal and observation tokens are inputs only. Both need the teacher's
tokenizer (`shared_vocab`): distillation into another tokenizer is `trajectory` mode
(agentkiln.trainers.supervised on the teacher's episodes re-rendered for the student).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from agentkiln.config import DistillParams
from agentkiln.envs import TaskSpec
from agentkiln.policy.model import Policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode
from agentkiln.trainers import checkpoint
from agentkiln.trainers.batch import Batch, allowed_mask, build_batch, hidden_at
from agentkiln.trainers.supervised import OptimConfig, length_grouped, resume, warmup_cosine

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
    distributions over the same token ids, in the same conversations."""
    vt, vs = teacher.tokenizer.get_vocab(), student.tokenizer.get_vocab()
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    same_specials = all(getattr(teacher.tokenizer, a) == getattr(student.tokenizer, a) for a in specials)
    if vt != vs or not same_specials:
        how = "different tokens or ids" if len(vt) == len(vs) else "different sizes"
        raise ValueError(
            f"distill.mode {mode}: the student's tokenizer differs from the teacher's (teacher vocabulary "
            f"{len(vt)} tokens, student vocabulary {len(vs)} tokens: {how}); token-level distillation compares "
            "distributions over the same token ids: use distill.mode: trajectory (it re-tokenizes the teacher's "
            "episodes) or a student with the teacher's tokenizer")
    if teacher.tokenizer.chat_template != student.tokenizer.chat_template or teacher.fmt != student.fmt:
        raise ValueError(f"distill.mode {mode}: the student's chat template or agent format differs from the "
                         "teacher's: token-level distillation needs the same conversations")
    if student.max_context < teacher.max_context:
        raise ValueError(f"distill.mode {mode}: the student's context ({student.max_context} tokens) is shorter than "
                         f"the teacher's ({teacher.max_context}): it could not read the teacher's episode windows")
    vocab = len(teacher.tokenizer)
    for name, pol in (("teacher", teacher), ("student", student)):
        if pol.vocab_size < vocab:
            raise ValueError(f"distill.mode {mode}: the {name} model has {pol.vocab_size} token embeddings, fewer "
                             f"than its tokenizer's {vocab} tokens")
    return vocab


# --------------------------------------------------------------------------- scores
def reply_logits(model: torch.nn.Module, batch: Batch, vocab: int) -> torch.Tensor:
    """[N, V] float logits at the positions that predict each reply token (batch.flat order), on the
    model's device."""
    batch = batch.to(next(model.parameters()).device)
    pred = batch.loss_mask.nonzero()
    pred[:, 1] -= 1
    h = hidden_at(model, batch.input_ids, batch.attention_mask, pred)
    return model.get_output_embeddings()(h)[:, :vocab].float()


@dataclass(frozen=True)
class KDConfig:
    temperature: float = 1.0
    support: str = "vocabulary"  # or "admissible": both distributions renormalised over the allowed tokens


TeacherScores = Callable[[list[int], Batch], torch.Tensor]  # (row indices, their batch) -> [N, V]


def _kd_pass(student: Policy, batch: Batch, teacher_scores: TeacherScores, loss_fn, kd: KDConfig,
             opt: torch.optim.Optimizer, sched, gen: torch.Generator, batch_size: int, max_grad_norm: float,
             vocab: int, desc: str) -> dict:
    """One pass over `batch`'s rows (length-grouped minibatches of `batch_size` windows); token-mean loss."""
    model = student.model
    model.train()
    tot_loss, tot_tok, teacher_lp, norms = 0.0, 0, 0.0, []
    bar = tqdm(length_grouped(batch.attention_mask.sum(1).tolist(), batch_size, gen), desc=desc, leave=False)
    for rows in bar:
        mb = batch.select(rows).to(student.device)
        allowed = allowed_mask(mb, vocab) if kd.support == "admissible" else None
        with student.autocast():
            s_logits = reply_logits(model, mb, vocab)
        t_logits = teacher_scores(rows, mb).to(s_logits.device)
        loss = loss_fn(s_logits, t_logits, torch.ones(len(s_logits), device=s_logits.device), kd.temperature, allowed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(student.trainable(), max_grad_norm)))
        opt.step()
        if sched is not None:
            sched.step()
        n = len(s_logits)
        targets = mb.flat(mb.input_ids)
        tot_loss += loss.item() * n
        tot_tok += n
        teacher_lp += float(_log_probs(t_logits, 1.0, allowed).gather(-1, targets[:, None]).sum())
        bar.set_postfix(loss=f"{loss.item():.4f}")
    model.eval()
    return {"loss": tot_loss / tot_tok, "teacher_logprob": teacher_lp / tot_tok,
            "grad_norm": sum(norms) / len(norms), "tokens": tot_tok, "steps": len(norms)}


def _kd_batch(episodes: list[Episode], pad_id: int, kd: KDConfig) -> Batch:
    batch = build_batch(episodes, pad_id)
    if kd.support != "admissible":
        batch.allowed = batch.allowed[..., :0]
    return batch


# --------------------------------------------------------------------------- forward KL (off-policy)
def train_forward_kl(student: Policy, teacher: Policy, episodes: list[Episode], cfg: OptimConfig, kd: KDConfig,
                     seed: int, log: Callable[[dict, int], None] | None = None, desc: str = "distill",
                     ckpt_dir: Path | None = None, ckpt_key: str = "") -> list[dict]:
    """Train `student` in place to minimise KL(teacher || student) on the teacher's `episodes` (their
    exact ids). Returns per-epoch metrics. The teacher's logits are computed once (cached; rescored per
    minibatch when the cache would exceed TEACHER_CACHE_BYTES). With `ckpt_dir`, resumes from a
    checkpoint of the same run (`ckpt_key`) and writes one per epoch."""
    vocab = shared_vocab(teacher, student, "forward-kl")
    batch = _kd_batch(episodes, teacher.pad_id, kd)
    if not batch.rows:
        raise ValueError(f"{desc}: no training episodes (no teacher episode was kept)")
    teacher.model.eval().requires_grad_(False)
    if batch.n_tokens * vocab * 4 <= TEACHER_CACHE_BYTES:
        cache: dict[int, torch.Tensor] = {}
        with torch.no_grad(), teacher.autocast():
            for r in range(batch.rows):
                cache[r] = reply_logits(teacher.model, batch.select([r]), vocab)

        def scores(rows, mb):
            return torch.cat([cache[r] for r in rows])
    else:
        def scores(rows, mb):
            with torch.no_grad(), teacher.autocast():
                return reply_logits(teacher.model, mb, vocab)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(student.trainable(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.epochs * math.ceil(batch.rows / cfg.batch_size))
    history, start = [], 0
    state = checkpoint.load(ckpt_dir, ckpt_key, gen=gen) if ckpt_dir else None
    if state is not None:
        start, history = resume(state, student.model, opt, sched, ckpt_dir, desc, "epoch", log)
    for epoch in range(start, cfg.epochs):
        stats = _kd_pass(student, batch, scores, forward_kl_loss, kd, opt, sched, gen, cfg.batch_size,
                         cfg.max_grad_norm, vocab, f"{desc} forward-kl epoch {epoch + 1}/{cfg.epochs}")
        row = {"epoch": epoch + 1, **stats, "lr": sched.get_last_lr()[0]}
        history.append(row)
        if log:
            log({f"{desc}/{k}": v for k, v in row.items() if k != "epoch"}, epoch + 1)
        if ckpt_dir:
            checkpoint.save(ckpt_dir, ckpt_key, {"model": student.model.state_dict(), "opt": opt.state_dict(),
                                                 "sched": sched.state_dict(), "done": epoch + 1, "history": history},
                            gen=gen)
    student.model.eval()
    return history


# --------------------------------------------------------------------------- reverse KL (on-policy, GKD)
def train_on_policy(student: Policy, teacher: Policy, pool: list[TaskSpec], tasks_dir, p: DistillParams, seed: int,
                    log: Callable[[dict, int], None] | None = None, desc: str = "distill",
                    ckpt_dir: Path | None = None, ckpt_key: str = "") -> list[dict]:
    """`p.iterations` rounds: the student plays `p.samples_per_task` episodes of each of `p.tasks_per_iter`
    tasks at `p.temperature`; the teacher scores every generated token in the same context ids;
    one pass of KL(student || teacher) over the round's episodes (constant lr `p.onpolicy_lr or p.lr`).
    Returns per-round metrics (the student's sampled success included). With `ckpt_dir`, resumes
    from a checkpoint of the same run (`ckpt_key`) and writes one per round."""
    vocab = shared_vocab(teacher, student, "on-policy")
    teacher.model.eval().requires_grad_(False)
    kd = KDConfig(p.kd_temperature, p.kd_support)
    opt = torch.optim.AdamW(student.trainable(), lr=p.onpolicy_lr or p.lr, weight_decay=p.weight_decay)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def scores(rows, mb):
        with teacher.autocast():
            return reply_logits(teacher.model, mb, vocab)

    history, start = [], 0
    state = checkpoint.load(ckpt_dir, ckpt_key, rng, gen) if ckpt_dir else None
    if state is not None:
        start, history = resume(state, student.model, opt, None, ckpt_dir, f"{desc}/onpolicy", "round", log)
    for it in tqdm(range(start, p.iterations), desc=f"{desc} on-policy rounds", initial=start, total=p.iterations):
        tasks = rng.sample(pool, min(p.tasks_per_iter, len(pool)))
        agent = PolicyAgent(student, temperature=p.temperature, seed=seed * 100_003 + it * 101 + 1,
                            decoding=p.decoding, max_reply_tokens=p.max_reply_tokens)
        episodes = run_episodes(agent, tasks, tasks_dir, p.max_turns, group_size=p.samples_per_task)
        batch = _kd_batch(episodes, student.pad_id, kd)
        stats = _kd_pass(student, batch, scores, reverse_kl_loss, kd, opt, None, gen, p.batch_size,
                         p.max_grad_norm, vocab, f"{desc} on-policy round {it + 1}/{p.iterations}")
        row = {"round": it + 1, "episodes": len(episodes), "windows": batch.rows,
               "success": sum(e.won for e in episodes) / len(episodes),
               "reward_mean": sum(e.reward for e in episodes) / len(episodes), **stats}
        history.append(row)
        if log:
            log({f"{desc}/onpolicy/{k}": v for k, v in row.items() if k != "round"}, it + 1)
        if ckpt_dir:
            checkpoint.save(ckpt_dir, ckpt_key, {"model": student.model.state_dict(), "opt": opt.state_dict(),
                                                 "done": it + 1, "history": history}, rng, gen)
    return history
