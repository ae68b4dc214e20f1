"""SFT cold start: tokenizer from the synthesized text, a policy, and NLL on expert actions."""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import Params
from agentkiln.policy import AgentFormat, build_prompt, build_scratch_policy, load_policy, save_policy
from agentkiln.schemas import load_expert_trajectories
from agentkiln.stages.common import expert_pairs
from agentkiln.trainers.supervised import OptimConfig, samples_from_states, train_supervised


def optim_config(p) -> OptimConfig:
    return OptimConfig(p.epochs, p.batch_size, p.lr, p.weight_decay, p.warmup_steps, p.max_grad_norm)


def run_sft(params: Params, tasks_dir: Path, out_dir: Path, log=None) -> dict:
    df = load_expert_trajectories(Path(tasks_dir) / "expert_trajectories.parquet")
    fmt = AgentFormat(history=params.sft.history)
    train = expert_pairs(df[df["split"] == "sft"])
    if params.sft.model.source == "scratch":
        # Vocabulary from every training-pool text (sft + rl); the test panel stays unseen.
        corpus = [build_prompt(fmt, s.goal, s.past_actions, s.observation, s.admissible) for s, _ in expert_pairs(df)]
        policy = build_scratch_policy(params.sft.model, corpus, fmt, seed=params.seed)
    else:
        policy = load_policy(params.sft.model.source, fmt)
    samples = samples_from_states(policy, train)
    history = train_supervised(policy, samples, optim_config(params.sft), seed=params.seed, log=log, desc="sft")
    save_policy(policy, out_dir)
    return {
        "n_params": policy.n_params(),
        "vocab_size": len(policy.tokenizer),
        "n_samples": len(samples),
        "n_tasks": int(df[df["split"] == "sft"]["task_id"].nunique()),
        "final_loss": history[-1]["loss"],
        "final_token_acc": history[-1]["token_acc"],
    }
