"""Trainer speed: agentkiln's RL update and SFT step against a raw forward+backward loop on the same rows.

Episodes are played once (the RL default batch, sampled), then the same rows (one per episode window,
right-padded, in the same minibatches) are trained three ways for `--steps` optimizer steps each:

- raw: `model(input_ids, attention_mask).logits`, cross-entropy over every position, backward, AdamW:
  the plain Hugging Face training loop;
- sft: `trainers.supervised`'s step (reply tokens only, LM head only where a reply token is predicted);
- rl: `trainers.rl.update` (PPO-clip + KL to a reference + entropy, micro-batch accumulation).

Tokens/s counts every token of every row (what the forward pass processes). The issue's bar: the
trainers reach >= 90% of the raw loop's tokens/s.

    python bench/trainer_speed.py                  # models/sft on the data/tasks rl pool
    python bench/trainer_speed.py --steps 8 --out bench/results/trainer_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.policy import load_policy
from agentkiln.seeding import seed_everything
from agentkiln.stages.common import load_split
from agentkiln.trainers.batch import build_batch, token_logprobs
from agentkiln.trainers.engine import LocalEngine
from agentkiln.trainers.rl import collect, score, update


def timed(fn, steps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(paths.SFT_MODEL))
    ap.add_argument("--tasks", default=str(paths.TASKS))
    ap.add_argument("--steps", type=int, default=4, help="timed minibatches per trainer")
    ap.add_argument("--out", default="bench/results/trainer_speed.json")
    args = ap.parse_args()
    params = load_params()
    seed_everything(params.seed, params.torch_threads)
    p = params.rl.stage(params.rl.final).model_copy(update={"dynamic_sampling": False, "ppo_epochs": 1})
    policy, ref = load_policy(args.model), load_policy(args.model)
    episodes, _, _ = collect(policy, load_split(args.tasks, "rl"), Path(args.tasks), p, random.Random(0), seed=0)
    batch = build_batch(episodes, policy.pad_id)
    batch.ref_logp = score(ref, batch, p.temperature, p.micro_batch_size or p.minibatch_size)
    batch.advantages = torch.randn(batch.rows)[:, None] * batch.loss_mask
    rows = list(range(min(p.minibatch_size, batch.rows)))
    mb = batch.select(rows)
    tokens = int(mb.attention_mask.sum())
    micro = p.micro_batch_size or p.minibatch_size
    model = policy.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def raw_step():
        model.train()
        opt.zero_grad(set_to_none=True)
        for k in range(0, len(rows), micro):
            sub = mb.select(list(range(k, min(k + micro, len(rows)))))
            logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), sub.input_ids[:, 1:].flatten(),
                                                     reduction="none")
            (loss * sub.attention_mask[:, 1:].flatten()).sum().div(tokens).backward()
        opt.step()

    def sft_step():
        model.train()
        opt.zero_grad(set_to_none=True)
        for k in range(0, len(rows), micro):
            sub = mb.select(list(range(k, min(k + micro, len(rows)))))
            logp, _ = token_logprobs(model, sub, with_entropy=False)
            (-logp.sum() / mb.n_tokens).backward()
        opt.step()

    gen = torch.Generator().manual_seed(0)
    one = p.model_copy(update={"minibatch_size": len(rows)})
    engine = LocalEngine(policy.model, opt, one.max_grad_norm, policy.trainable())

    def rl_step():
        update(engine, policy, None, mb, one, None, gen)

    raw_s, sft_s, rl_s = (timed(fn, args.steps) for fn in (raw_step, sft_step, rl_step))
    result = {
        "model": args.model, "params": policy.n_params(), "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "rows": len(rows), "micro_batch": micro,
        "tokens_per_step": tokens, "reply_tokens_per_step": mb.n_tokens,
        "raw_tokens_per_s": round(tokens / raw_s), "sft_tokens_per_s": round(tokens / sft_s),
        "rl_tokens_per_s": round(tokens / rl_s),
        "sft_vs_raw": round(raw_s / sft_s, 3), "rl_vs_raw": round(raw_s / rl_s, 3), "target": 0.9,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
