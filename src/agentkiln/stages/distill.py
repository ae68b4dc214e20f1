"""Distillation: a smaller student learns from the RL teacher, in one of three modes (docs/distillation.md).

- `trajectory`: SFT on the teacher's successful episodes (rejection sampling). A student that talks
  exactly like the teacher (same tokenizer, template, format, context) trains on the teacher's
  generated ids; any other student on the same episodes rendered with its own tokenizer.
- `forward-kl`: KL(teacher || student) at every reply token of the teacher's episodes.
- `on-policy`: optional trajectory warm start, then rounds of student sampling scored by the teacher,
  KL(student || teacher) on the student's own tokens (GKD).

A killed stage resumes (models/checkpoints/distill) when run again with the same params, seed,
thread count, data, teacher and student: the seeded teacher rollouts are played again (the same
episodes), then training continues after its last finished epoch or round. The checkpoint is
removed once every output is written (the model, then `outputs`: reports and MLflow logging), never before.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agentkiln import fanout
from agentkiln.config import ComputeParams, DistillParams, Params
from agentkiln.evaluate.agents import policy_agent
from agentkiln.policy import AgentFormat, Policy, build_scratch_policy, load_policy, save_policy
from agentkiln.policy.model import build_scratch_model, place
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode
from agentkiln.stages.base import corpus, pool_episodes
from agentkiln.stages.common import load_split
from agentkiln.stages.sft import optim_config, render_all
from agentkiln.trainers import checkpoint
from agentkiln.trainers.distill import KDConfig, shared_vocab, train_forward_kl, train_on_policy
from agentkiln.trainers.select import play_panel
from agentkiln.trainers.student_init import teacher_embedding_init
from agentkiln.trainers.supervised import train_supervised


def build_student(p: DistillParams, teacher: Policy, seed: int, compute: ComputeParams | None = None,
                  texts: Callable[[], list[str]] | None = None) -> Policy:
    """The student: a scratch model with the teacher's tokenizer and agent format when that vocabulary fits
    `student.vocab_size` (a scratch teacher's, trained on the tasks); under a larger one (a pretrained
    teacher's: SmolLM2's 49,152 tokens would be most of a small student) it trains its own BPE of that size
    on `texts()` (the training pools' text) and talks in the scratch format (no system prompts), learning
    from the teacher's episodes re-rendered (trajectory mode). Any other source: that model directory."""
    if p.student.source == "scratch":
        if len(teacher.tokenizer) <= p.student.vocab_size or texts is None:
            model = build_scratch_model(p.student, teacher.tokenizer, seed=seed)
            source = "scratch student"
            if p.embed_init == "teacher":
                teacher_embedding_init(model, teacher.model)
                source = "scratch student on the teacher's embeddings"
            return place(Policy(model, teacher.tokenizer, teacher.fmt, p.student.max_context, source), compute)
        # its own tokenizer: the teacher's embeddings are of other tokens, so `embed_init` has nothing to take
        student = build_scratch_policy(p.student, texts(), AgentFormat(), seed=seed, compute=compute)
        student.source = "scratch student (own tokenizer)"
        return student
    if p.embed_init == "teacher":
        raise ValueError(f"distill.embed_init: 'teacher' initialises a scratch student; distill.student.source is "
                         f"{p.student.source!r}, a trained model: set distill.embed_init: random")
    return load_policy(p.student.source, teacher.fmt, context=p.student.max_context, compute=compute)


def speaks_like(student: Policy, teacher: Policy) -> bool:
    """Same ids for the same conversation: the teacher's generated ids are the student's to train on."""
    return (student.tokenizer is teacher.tokenizer or student.tokenizer.get_vocab() == teacher.tokenizer.get_vocab()) \
        and student.tokenizer.chat_template == teacher.tokenizer.chat_template and student.fmt == teacher.fmt \
        and student.max_context >= teacher.max_context


def teacher_episodes(teacher: Policy, pool, tasks_dir: Path, p: DistillParams, seed: int) -> list[Episode]:
    """`samples_per_task` teacher episodes per task at `temperature` (the same in every mode)."""
    agent = PolicyAgent(teacher, temperature=p.temperature, seed=seed, decoding=p.decoding,
                        max_reply_tokens=p.max_reply_tokens)
    return run_episodes(agent, pool, tasks_dir, p.max_turns, group_size=p.samples_per_task, progress="teacher rollouts")


def train_restarts(params: Params, teacher: Policy, first: Policy, won: list[Episode], demos: list[Episode],
                   tasks_dir: Path, cfg, desc: str, ckpt: dict, log=None) -> tuple[Policy, int, list[dict], list[dict]]:
    """`restarts` students (seeds seed, seed+1, ...; `first` is seed's) each train `restart_epochs` epochs of
    the full schedule and play `restart_panel` greedily, as the evaluate stage plays it; the best (ties: the
    lower seed) trains on from its checkpoint to the end of the schedule, as a run never stopped would.
    Returns (student, its seed, every student's look, its history). Why: a small student trained on the
    same wins lands on a lake-playing solution or not by its seed alone (docs/journal.md, 2026-12-07).
    With `ckpt` (the stage's slot) the looks are kept beside the students' checkpoints: a resumed stage
    plays no student again and makes the same choice."""
    p = params.distill
    panel = load_split(tasks_dir, p.restart_panel)
    with contextlib.ExitStack() as stack:
        root = Path(ckpt["ckpt_dir"]) if ckpt else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="agentkiln-restarts-")))
        key = ckpt.get("ckpt_key", desc)
        seen = root / "restart_looks.json"
        looks: list[dict] = json.loads(seen.read_text()) if seen.exists() else []
        best = None
        for r in range(p.restarts):
            seed = params.seed + r
            student = first if r == 0 else build_student(p, teacher, seed, params.compute)
            mine = demos if r == 0 or speaks_like(student, teacher) else render_all(student, won, p.max_reply_tokens)
            slot = {"ckpt_dir": root / f"r{r}", "ckpt_key": f"{key}:r{r}"}
            if r == len(looks):  # not played yet
                train_supervised(student, mine, cfg, seed=seed, desc=f"{desc} seed {seed}",
                                 stop_after=p.restart_epochs, **slot)
                student.model.eval()
                looks.append({"seed": seed, **play_panel(policy_agent(student, params.evaluate, greedy=True), panel,
                                                         tasks_dir, params.evaluate.max_turns,
                                                         progress=f"{desc}: seed {seed} on {p.restart_panel}")})
                seen.parent.mkdir(parents=True, exist_ok=True)
                seen.write_text(json.dumps(looks))
                print(f"{desc}: seed {seed} plays {looks[r]['all']:.3f} on {p.restart_panel} after "
                      f"{p.restart_epochs} epochs", flush=True)
            if log:
                log({f"restart/{k}": v for k, v in looks[r].items() if k != "seed"}, r)
            if best is None or looks[r]["all"] > looks[best[0]]["all"]:  # ties: the lower seed
                best = (r, student, mine, slot)
            student = None  # a dropped student's weights go with it
        r, student, mine, slot = best
        history = train_supervised(student, mine, cfg, seed=params.seed + r, log=log, desc=desc, **slot)
    return student, params.seed + r, looks, history


@fanout.in_session
def run_distill(params: Params, tasks_dir: Path, teacher_dir: Path, out_dir: Path, log=None,
                ckpt_dir: Path | None = None, outputs: Callable[[dict], object] | None = None) -> dict:
    """Train and save the student to `out_dir`; its report. `outputs(report)` writes the stage's other
    outputs (the flow's reports and MLflow logging) before the checkpoint is removed (checkpoint.finish)."""
    p = params.distill
    if params.compute.backend == "deepspeed":  # said, not silently ignored
        print("distill: compute.backend deepspeed trains the sft and rl stages; the student trains in this one "
              "process (docs/scale.md)", flush=True)
    key = ""
    if ckpt_dir:
        key = checkpoint.fingerprint("distill", p.model_dump(), params.seed, params.torch_threads,
                                     files=[tasks_dir, teacher_dir] + ([] if p.student.source == "scratch"
                                                                       else [Path(p.student.source)]))

    def slot(phase: str) -> dict:  # each training phase checkpoints apart (a finished phase is skipped)
        return {"ckpt_dir": Path(ckpt_dir) / phase, "ckpt_key": f"{key}:{phase}"} if ckpt_dir else {}

    teacher = load_policy(teacher_dir, compute=params.compute)
    student = build_student(p, teacher, params.seed, params.compute,
                            texts=lambda: corpus(AgentFormat(), pool_episodes(params, tasks_dir)))
    if p.mode != "trajectory":
        shared_vocab(teacher, student, p.mode)  # fail before any rollout
    pool = load_split(tasks_dir, "sft") + load_split(tasks_dir, "rl")  # training pools only
    report: dict = {"mode": p.mode, "teacher_params": teacher.n_params(), "student_params": student.n_params(),
                    "student": student.source}

    sft_epochs = {"trajectory": p.epochs, "forward-kl": 0, "on-policy": p.warmup_epochs}[p.mode]
    if sft_epochs or p.mode == "forward-kl":
        episodes = teacher_episodes(teacher, pool, tasks_dir, p, params.seed)
        won = [e for e in episodes if e.won]
        report |= {"teacher_episodes": len(episodes), "teacher_sample_success": len(won) / max(1, len(episodes))}

    if sft_epochs:  # trajectory mode, or on-policy's warm start
        same = speaks_like(student, teacher)
        demos = won if same else render_all(student, won, p.max_reply_tokens)  # rejection sampling
        cfg = replace(optim_config(p), epochs=sft_epochs)
        desc = "distill" if p.mode == "trajectory" else "distill-warmup"
        if p.restarts > 1:
            student, seed, looks, history = train_restarts(params, teacher, student, won, demos, tasks_dir, cfg, desc,
                                                           slot(desc), log)
            report |= {"restart_seed": seed, "restart_looks": looks}
        else:
            history = train_supervised(student, demos, cfg, seed=params.seed, log=log, desc=desc, **slot(desc))
        prefix = "" if p.mode == "trajectory" else "warmup_"
        report |= {f"{prefix}n_episodes": len(demos), f"{prefix}final_loss": history[-1]["loss"],
                   "teacher_ids": same}

    if p.mode == "forward-kl":
        kept = won if p.only_successful else episodes
        history = train_forward_kl(student, teacher, kept, optim_config(p), KDConfig(p.kd_temperature, p.kd_support),
                                   seed=params.seed, log=log, **slot("forward-kl"))
        report |= {"kept_episodes": len(kept), "n_tokens": history[-1]["tokens"],
                   "final_loss": history[-1]["loss"], "final_teacher_logprob": history[-1]["teacher_logprob"]}

    if p.mode == "on-policy":
        rounds = train_on_policy(student, teacher, pool, tasks_dir, p, seed=params.seed, log=log, **slot("on-policy"))
        report |= {"student_episodes": sum(r["episodes"] for r in rounds), "n_tokens": sum(r["tokens"] for r in rounds),
                   "final_loss": rounds[-1]["loss"], "final_success": rounds[-1]["success"], "rounds": rounds}

    save_policy(student, out_dir)
    return checkpoint.finish(report, ckpt_dir, outputs)
