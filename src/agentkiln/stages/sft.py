"""SFT cold start: a policy (scratch: tokenizer trained on the task text + random weights; or a local
chat model), trained on the expert's whole episodes, loss on the agent's reply tokens only.

Which episodes: `sft.data` (stages.sft_data): the clean walkthroughs, recovery episodes (their injected
mistakes are context with no loss) and alternative walkthroughs in the given weights, plus optionally
a saved policy's own won episodes on the sft tasks, and the won episodes of a collected split
(`sft.data.collected`: episodes an agent harness played through `agentkiln endpoint`).

A killed stage resumes after its last finished epoch (models/checkpoints/sft) when run again with the
same params, seed, thread count, data and starting model; the checkpoint is removed once every output
is written (the model, then `outputs`: reports and MLflow logging), never before.

With `compute.backend: deepspeed` the stage builds the policy on the CPU, launches
`compute.deepspeed.num_procs` data-parallel ranks (trainers.distributed) and waits: rank 0 relays the
per-epoch metrics, writes the checkpoints and saves the model (adapter and checked merge included).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentkiln.config import Params
from agentkiln.envs import FAMILIES, env_class
from agentkiln.policy import AgentFormat, load_policy, lora, partial, save_policy
from agentkiln.policy.model import Policy, place
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.sequence import render
from agentkiln.schemas import load_expert_trajectories
from agentkiln.collected import load_split, training_episodes
from agentkiln.stages.base import base_policy, corpus
from agentkiln.stages.sft_data import mixture, own_wins, same_ids
from agentkiln.trainers import checkpoint, distributed
from agentkiln.trainers.supervised import OptimConfig, train_supervised


def optim_config(p) -> OptimConfig:
    return OptimConfig(p.epochs, p.batch_size, p.lr, p.weight_decay, p.warmup_steps, p.max_grad_norm)


def render_all(policy: Policy, episodes: list[Episode], reply_tokens: int | None = None) -> list[Episode]:
    """Token sequences of text episodes, each under its family's reply budget and tools."""
    out = []
    for ep in episodes:
        cls = env_class(ep.family)
        tools = cls.tool_specs() if policy.fmt.native_tools else None
        out.append(render(policy, ep, reply_tokens or cls.max_reply_tokens, tools))
    return out


def run_sft(params: Params, tasks_dir: Path, out_dir: Path, log=None, ckpt_dir: Path | None = None,
            outputs: Callable[[dict], object] | None = None, base_dir: Path | None = None) -> dict:
    """Train and save the SFT policy to `out_dir`, starting from the base policy in `base_dir` (None: built
    here from sft.model as the base stage builds it); its metrics. `outputs(metrics)` writes the stage's
    other outputs (the flow's reports and MLflow logging) before the checkpoint is removed (checkpoint.finish)."""
    df = load_expert_trajectories(Path(tasks_dir) / "expert_trajectories.parquet")
    fmt = AgentFormat(**params.sft.agent.model_dump())
    data = params.sft.data
    demos, counts = mixture(df[df["split"] == "sft"], data, params.seed)
    model = params.sft.model
    ranks = params.compute.backend == "deepspeed"
    if ranks:
        distributed.plan(params.compute)  # a setting this machine cannot honour stops the run before any work
    compute = distributed.parent_compute(params.compute) if ranks else params.compute
    if data.own_wins.policy is not None:  # played first: a missing policy stops the stage before any training
        won, player, played = own_wins(data.own_wins, Path(tasks_dir), compute, params.seed)
        counts |= {"own_wins": len(won), "own_played": played}
    if data.collected is not None:  # read and checked first: a bad split stops the stage before any training
        collected = load_split(data.collected, "sft.data.collected")
    if base_dir is not None:  # the base stage's model (its agent.json: the format, the context)
        policy = load_policy(base_dir, probe=corpus(fmt, demos[:8]), compute=compute)
    else:  # built here, as the base stage builds it (the findings' own SFT arms)
        policy = place(base_policy(params, tasks_dir)[0], compute)
    if params.sft.lora.enabled:
        lora.add_lora(policy, params.sft.lora, seed=params.seed)
    episodes = render_all(policy, demos)
    if data.own_wins.policy is not None:
        episodes += won if same_ids(player, policy) else render_all(policy, won)
    if data.collected is not None:  # rejection sampling from a harness: the won episodes the endpoint recorded
        served, text = training_episodes(collected, policy, won_only=True)
        text = [e for e in text if e.family in FAMILIES]  # text to render needs its family's reply budget and tools
        episodes += served + render_all(policy, text)
        counts |= {"collected_won": len(served) + len(text), "collected_as_served": len(served),
                   "collected_episodes": len(collected)}
    key = ""
    if ckpt_dir:
        # the rendezvous port does not change what a run computes: a resumed run may use another one
        compute_key = params.compute.model_dump(exclude={"deepspeed": {"master_port"}} if ranks else None)
        key = checkpoint.fingerprint("sft", params.sft.model_dump(), compute_key, params.seed,
                                     params.torch_threads,
                                     files=[tasks_dir] + ([Path(base_dir)] if base_dir is not None else [])
                                     + ([Path(model.source)] if model.source != "scratch" and base_dir is None
                                        and Path(model.source).exists() else [])
                                     + ([Path(data.own_wins.policy)] if data.own_wins.policy else [])
                                     + ([Path(data.collected)] if data.collected else []))
    if ranks:
        job = {"policy": policy, "episodes": episodes, "cfg": optim_config(params.sft), "seed": params.seed,
               "out_dir": Path(out_dir), "ckpt_dir": ckpt_dir and Path(ckpt_dir), "ckpt_key": key,
               "top_layers": params.sft.top_layers}
        done = distributed.launch(_sft_rank, job, params.compute, log=log)
        history, merged = done["history"], done["merged"]
    else:
        with partial.top_layers(policy, params.sft.top_layers):
            history = train_supervised(policy, episodes, optim_config(params.sft), seed=params.seed, log=log,
                                       desc="sft", ckpt_dir=ckpt_dir, ckpt_key=key)
        merged = lora.merge(policy, out_dir) if lora.has_lora(policy) else None
        save_policy(policy, out_dir)
    return checkpoint.finish({
        "n_params": policy.n_params(),
        "vocab_size": len(policy.tokenizer),
        "n_episodes": len(episodes),
        "n_windows": sum(len(e.windows) for e in episodes),
        "n_tokens": sum(len(e.ids) for e in episodes),
        "n_reply_tokens": sum(e.n_tokens for e in episodes),
        "n_tasks": int(df[df["split"] == "sft"]["task_id"].nunique()),
        **{f"n_episodes_{k}": v for k, v in counts.items()},
        "final_loss": history[-1]["loss"],
        "final_token_acc": history[-1]["token_acc"],
        **({f"lora_{k}": v for k, v in merged.items()} if merged else {}),
    }, ckpt_dir, outputs)


def _sft_rank(rank: distributed.Rank, job: dict) -> dict | None:
    """One DeepSpeed rank of the SFT stage: train its share; rank 0 then saves the model from a fresh
    unsharded copy of the starting policy loaded with the final weights (the parent removes the
    checkpoint, once every output is written)."""
    policy = place(job["policy"], rank.compute)
    factory = distributed.RankFactory(rank)
    with partial.top_layers(policy, job["top_layers"]):
        history = train_supervised(policy, job["episodes"], job["cfg"], seed=job["seed"], desc="sft",
                                   ckpt_dir=job["ckpt_dir"], ckpt_key=job["ckpt_key"], make_engine=factory)
    weights = factory.engine.weights()  # every rank takes part
    if not rank.main:
        return None
    final = rank.job()["policy"]
    final.model.load_state_dict(weights)
    final.model.eval()
    merged = lora.merge(final, job["out_dir"]) if lora.has_lora(final) else None
    save_policy(final, job["out_dir"])
    return {"history": history, "merged": merged}
