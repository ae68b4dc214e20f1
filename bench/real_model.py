"""The real model on this machine: SmolLM2-135M-Instruct's rollouts and RL update, against plain Hugging Face.

One RL iteration's worth of work at the profile's settings (profiles/smollm2.yaml: 8 tasks x 8 episodes of
the RL pool, rollouts at T 0.7, groups from one initial state), measured three ways, in bf16 (autocast)
and fp32, each configuration in a fresh process (its own peak memory):

- rollout: agentkiln's engine (`run_episodes` + `PolicyAgent`: one KV cache kept across turns, one prefill
  per group, logits only at the sampled position, constrained decoding) against Hugging Face `generate` on
  the same token schedule (per turn, the batch of live episodes: their whole window as the prompt, left-padded,
  and as many new tokens as the engine's longest reply of that turn; no environments, no constraints).
  tokens/s counts every token of every episode (prompts, observations, replies) over the wall time;
  `rollout_vs_generate` = generate's time / the engine's (bar: >= 2).
- update: `trainers.rl.update` (PPO-clip, token-mean, micro-batch accumulation, length-bucketed micro-batches,
  LM head only at reply tokens) on the iteration's rows against a raw loop on the same rows and micro-batches
  (`model(input_ids, attention_mask).logits`, cross-entropy at every position, backward, AdamW);
  `update_vs_raw` = raw time / update time (bar: >= 0.9). Both train the whole model (the profile's
  `top_layers` is reported apart: `update_top_layers_vs_whole`).
- `bf16_vs_fp32`: each of those in bf16 autocast against fp32 (fp32 master weights either way).

    python bench/real_model.py                                  # models/sft (dvc repro sft with the profile): an RL iteration starts there
    python bench/real_model.py --model models/sft --tasks data/tasks --out bench/results/real_model.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import time
from pathlib import Path

import torch


def machine() -> dict:
    from agentkiln.policy.device import cpu_name, native_bf16

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "native_bf16": native_bf16(torch.device("cpu"))}


def _setup(model: str, tasks: str, dtype: str, threads: int):
    from agentkiln.config import ComputeParams
    from agentkiln.policy import load_policy
    from agentkiln.seeding import seed_everything

    seed_everything(0, threads)
    return load_policy(model, compute=ComputeParams(device="cpu", dtype=dtype))


def _pool(tasks: str, n_tasks: int):
    """The RL pool's first `n_tasks` lakes and cooking games (the profile's RL mix)."""
    from agentkiln.stages.common import load_split

    pool = [t for t in load_split(tasks, "rl") if t.task_type in ("cooking", "frozenlake_easy", "frozenlake_5")]
    random.Random(0).shuffle(pool)
    return pool[:n_tasks]


def rollout_job(model: str, tasks: str, dtype: str, threads: int, n_tasks: int, group: int) -> dict:
    from transformers import GenerationConfig

    from agentkiln.rollout.agents import PolicyAgent
    from agentkiln.rollout.engine import run_episodes

    policy = _setup(model, tasks, dtype, threads)
    pool = _pool(tasks, n_tasks)
    agent = PolicyAgent(policy, temperature=0.7, seed=0, batch_size=n_tasks * group)
    run_episodes(agent, pool[:1], tasks, 2, group_size=2)  # warm-up
    start = time.perf_counter()
    episodes = run_episodes(agent, pool, tasks, None, group_size=group)
    engine_s = time.perf_counter() - start
    tokens = sum(len(ep.ids) for ep in episodes)
    # the same schedule with generate: per turn, every live episode's window and its reply length
    model_ = policy.model.eval()
    pad = policy.pad_id
    cfg = GenerationConfig(do_sample=False, pad_token_id=pad, eos_token_id=None)
    turns = max(len(ep.turns) for ep in episodes)
    start = time.perf_counter()
    with torch.no_grad(), policy.autocast():
        for k in range(turns):
            live = [ep for ep in episodes if len(ep.turns) > k]
            prompts = []
            for ep in live:
                t = ep.turns[k]
                w = ep.windows[t.window]
                prompts.append((ep.ids[: ep.prompt_len] if w[0] else []) + ep.ids[w[0]: t.start])
            width, new = max(map(len, prompts)), max(ep.turns[k].n_tokens for ep in live)
            ids = torch.full((len(prompts), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            model_.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, max_new_tokens=new,
                            min_new_tokens=new)
    generate_s = time.perf_counter() - start
    return {"episodes": len(episodes), "tokens": tokens, "generated": sum(ep.n_tokens for ep in episodes),
            "turns_mean": round(sum(len(ep.turns) for ep in episodes) / len(episodes), 2),
            "engine_s": round(engine_s, 2), "generate_s": round(generate_s, 2),
            "engine_tokens_per_s": round(tokens / engine_s), "generate_tokens_per_s": round(tokens / generate_s),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def update_job(model: str, tasks: str, dtype: str, threads: int, n_tasks: int, group: int, top_layers: int | None,
               steps: int) -> dict:
    from agentkiln.config import RLParams
    from agentkiln.policy import partial
    from agentkiln.rollout.agents import PolicyAgent
    from agentkiln.rollout.engine import run_episodes
    from agentkiln.trainers.batch import build_batch
    from agentkiln.trainers.engine import LocalEngine
    from agentkiln.trainers.rl import update

    policy = _setup(model, tasks, dtype, threads)
    episodes = run_episodes(PolicyAgent(policy, temperature=0.7, seed=0, batch_size=n_tasks * group),
                            _pool(tasks, n_tasks), tasks, None, group_size=group)
    batch = build_batch(episodes, policy.pad_id)
    batch.advantages = torch.randn(batch.rows, generator=torch.Generator().manual_seed(0))[:, None] * batch.loss_mask
    p = RLParams(minibatch_size=16, micro_batch_size=4, lr=1e-6, ppo_epochs=1)
    rows = list(range(min(p.minibatch_size, batch.rows)))
    mb = batch.select(rows)
    tokens = int(mb.attention_mask.sum())
    one = p.model_copy(update={"minibatch_size": len(rows)})
    gen = torch.Generator().manual_seed(0)
    model_ = policy.model

    def timed(fn) -> float:
        fn()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps

    with partial.top_layers(policy, top_layers):
        opt = torch.optim.AdamW(policy.trainable(), lr=1e-6)
        engine = LocalEngine(model_, opt, one.max_grad_norm, policy.trainable())
        update_s = timed(lambda: update(engine, policy, None, mb, one, None, gen))

        def raw_step():
            model_.train()
            opt.zero_grad(set_to_none=True)
            from agentkiln.trainers.rl import by_length

            order = by_length(mb)
            for k in range(0, len(rows), p.micro_batch_size):
                sub = mb.select(order[k: k + p.micro_batch_size])
                with policy.autocast():
                    logits = model_(input_ids=sub.input_ids, attention_mask=sub.attention_mask).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                         sub.input_ids[:, 1:].flatten(), reduction="none")
                (loss * sub.attention_mask[:, 1:].flatten()).sum().div(tokens).backward()
            opt.step()

        raw_s = timed(raw_step) if top_layers is None else None
    return {"rows": len(rows), "tokens_per_step": tokens, "reply_tokens_per_step": mb.n_tokens,
            "update_s": round(update_s, 2), "update_tokens_per_s": round(tokens / update_s),
            **({"raw_s": round(raw_s, 2), "raw_tokens_per_s": round(tokens / raw_s)} if raw_s else {}),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def in_process(fn, *args) -> dict:
    """`fn(*args)` in a fresh spawned process (its own peak memory, no state from the last job)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/sft")
    ap.add_argument("--tasks", default="data/tasks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks-per-iter", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--top-layers", type=int, default=15, help="the profile's partial fine-tuning, timed apart")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per trainer")
    ap.add_argument("--out", default="bench/results/real_model.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = (args.model, args.tasks)
    out: dict = {"bench": "real_model", "model": args.model, "machine": machine(),
                 "schedule": {"tasks": args.tasks_per_iter, "group": args.group, "temperature": 0.7}}
    for dtype in ("bf16", "fp32"):
        print(f"real_model: {dtype} rollout", flush=True)
        out[f"rollout_{dtype}"] = in_process(rollout_job, *common, dtype, args.threads, args.tasks_per_iter, args.group)
        print(f"real_model: {dtype} update", flush=True)
        out[f"update_{dtype}"] = in_process(update_job, *common, dtype, args.threads, args.tasks_per_iter, args.group,
                                            None, args.steps)
    out["update_top_layers_bf16"] = in_process(update_job, *common, "bf16", args.threads, args.tasks_per_iter,
                                               args.group, args.top_layers, args.steps) | {"top_layers": args.top_layers}
    r, u = out["rollout_bf16"], out["update_bf16"]
    out["rollout_vs_generate"] = round(r["generate_s"] / r["engine_s"], 3)
    out["rollout_vs_generate_fp32"] = round(out["rollout_fp32"]["generate_s"] / out["rollout_fp32"]["engine_s"], 3)
    out["update_vs_raw"] = round(u["raw_s"] / u["update_s"], 3)
    out["update_vs_raw_fp32"] = round(out["update_fp32"]["raw_s"] / out["update_fp32"]["update_s"], 3)
    out["bf16_vs_fp32"] = {"rollout": round(out["rollout_fp32"]["engine_s"] / r["engine_s"], 3),
                           "update": round(out["update_fp32"]["update_s"] / u["update_s"], 3)}
    out["update_top_layers_vs_whole"] = round(u["update_s"] / out["update_top_layers_bf16"]["update_s"], 3)
    out["targets"] = {"rollout_vs_generate": 2.0, "update_vs_raw": 0.9}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict) or k == "bf16_vs_fp32"}, indent=2))


if __name__ == "__main__":
    main()
