"""SFT cold start: a policy (scratch: tokenizer trained on the task text + random weights; or a local
chat model), trained on the expert's whole episodes, loss on the agent's reply tokens only.

A killed stage resumes after its last finished epoch (models/checkpoints/sft) when run again with the
same params, seed, thread count, data and starting model; the checkpoint is removed once it finishes.
"""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import Params
from agentkiln.envs import env_class
from agentkiln.policy import AgentFormat, build_scratch_policy, load_policy, lora, observation_text, save_policy
from agentkiln.policy.model import Policy
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.sequence import render
from agentkiln.schemas import load_expert_trajectories
from agentkiln.stages.common import expert_episodes
from agentkiln.trainers import checkpoint
from agentkiln.trainers.supervised import OptimConfig, train_supervised


def optim_config(p) -> OptimConfig:
    return OptimConfig(p.epochs, p.batch_size, p.lr, p.weight_decay, p.warmup_steps, p.max_grad_norm)


def corpus(fmt: AgentFormat, episodes: list[Episode]) -> list[str]:
    """Every text the agent reads or writes in these episodes (the scratch tokenizer's training text)."""
    texts = []
    for ep in episodes:
        for k, t in enumerate(ep.turns):
            texts += [observation_text(fmt, t.observation, t.admissible, ep.goal if k == 0 else None), t.action]
    return texts


def render_all(policy: Policy, episodes: list[Episode], reply_tokens: int | None = None) -> list[Episode]:
    """Token sequences of text episodes, each under its family's reply budget and tools."""
    out = []
    for ep in episodes:
        cls = env_class(ep.family)
        tools = cls.tool_specs() if policy.fmt.native_tools else None
        out.append(render(policy, ep, reply_tokens or cls.max_reply_tokens, tools))
    return out


def run_sft(params: Params, tasks_dir: Path, out_dir: Path, log=None, ckpt_dir: Path | None = None) -> dict:
    df = load_expert_trajectories(Path(tasks_dir) / "expert_trajectories.parquet")
    fmt = AgentFormat(**params.sft.agent.model_dump())
    demos = expert_episodes(df[df["split"] == "sft"])
    model = params.sft.model
    if model.source == "scratch":
        # vocabulary from every training-pool text (sft + rl); the test panel stays unseen
        policy = build_scratch_policy(model, corpus(fmt, expert_episodes(df)), fmt, seed=params.seed,
                                      compute=params.compute)
    else:
        policy = load_policy(model.source, fmt, context=model.max_context, probe=corpus(fmt, demos[:8]),
                             compute=params.compute)
    if params.sft.lora.enabled:
        lora.add_lora(policy, params.sft.lora, seed=params.seed)
    episodes = render_all(policy, demos)
    key = ""
    if ckpt_dir:
        key = checkpoint.fingerprint("sft", params.sft.model_dump(), params.compute.model_dump(), params.seed,
                                     params.torch_threads,
                                     files=[tasks_dir] + ([] if model.source == "scratch" else [Path(model.source)]))
    history = train_supervised(policy, episodes, optim_config(params.sft), seed=params.seed, log=log, desc="sft",
                               ckpt_dir=ckpt_dir, ckpt_key=key)
    merged = lora.merge(policy, out_dir) if lora.has_lora(policy) else None
    save_policy(policy, out_dir)
    if ckpt_dir:
        checkpoint.clear(ckpt_dir)
    return {
        "n_params": policy.n_params(),
        "vocab_size": len(policy.tokenizer),
        "n_episodes": len(episodes),
        "n_windows": sum(len(e.windows) for e in episodes),
        "n_tokens": sum(len(e.ids) for e in episodes),
        "n_reply_tokens": sum(e.n_tokens for e in episodes),
        "n_tasks": int(df[df["split"] == "sft"]["task_id"].nunique()),
        "final_loss": history[-1]["loss"],
        "final_token_acc": history[-1]["token_acc"],
        **({f"lora_{k}": v for k, v in merged.items()} if merged else {}),
    }
