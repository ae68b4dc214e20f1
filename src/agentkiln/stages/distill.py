"""Trajectory distillation: a smaller student learns from the RL teacher's successful episodes."""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import Params
from agentkiln.policy import Policy, load_policy, save_policy
from agentkiln.policy.model import build_scratch_model
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.stages.common import load_split
from agentkiln.stages.sft import optim_config
from agentkiln.trainers.supervised import samples_from_states, train_supervised


def run_distill(params: Params, tasks_dir: Path, teacher_dir: Path, out_dir: Path, log=None) -> dict:
    p = params.distill
    teacher = load_policy(teacher_dir)
    pool = load_split(tasks_dir, "sft") + load_split(tasks_dir, "rl")  # training pools only
    agent = PolicyAgent(teacher, temperature=p.temperature, seed=params.seed)
    episodes = run_episodes(agent, pool, tasks_dir, p.max_turns, group_size=p.samples_per_task, progress="teacher rollouts")
    kept = [e for e in episodes if e.won]  # rejection sampling
    pairs = [(t.state, t.gen.action) for e in kept for t in e.turns]
    if p.student.source == "scratch":
        student = Policy(build_scratch_model(p.student, teacher.tokenizer, seed=params.seed), teacher.tokenizer, teacher.fmt)
    else:
        student = load_policy(p.student.source, teacher.fmt)
    samples = samples_from_states(student, pairs)
    history = train_supervised(student, samples, optim_config(p), seed=params.seed, log=log, desc="distill")
    save_policy(student, out_dir)
    return {
        "teacher_params": teacher.n_params(),
        "student_params": student.n_params(),
        "teacher_episodes": len(episodes),
        "teacher_sample_success": len(kept) / max(1, len(episodes)),
        "n_samples": len(samples),
        "final_loss": history[-1]["loss"],
    }
