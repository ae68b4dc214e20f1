"""Rollout speed: agentkiln's multi-turn rollout against a raw batched forward loop of the same model.

The rollout (`run_episodes` + `PolicyAgent`) plays a panel at the RL default batch. Then the raw loop
replays exactly the same token schedule with plain Hugging Face calls and a DynamicCache (per chunk,
per turn: one left-padded prefill of every active row's new tokens, then one decoding step per reply
token; no environments, no sampling logic, no bookkeeping): the cost of the model alone, batched the
obvious way. Reported:

- rollout wall time, and its environment share (time inside `env.reset`/`env.step`);
- tokens/s of the rollout (every token fed to the model: prompts, observations, replies) and of the
  raw loop on the same tokens;
- overhead = (rollout - environment) / raw - 1: what the engine costs over the raw model loop (negative:
  faster than the raw loop; grouping similar rows pads less).

    python bench/rollout_speed.py                           # data/tasks test panel, models/sft if present
    python bench/rollout_speed.py --model models/rl/main --batch 64 --out bench/results/rollout_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.envs.base import Env
from agentkiln.policy import load_policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.seeding import seed_everything
from agentkiln.stages.common import load_split


class EnvClock:
    """Time spent inside environments (wraps Env.reset and Env.step)."""

    def __init__(self):
        self.seconds = 0.0
        self._reset, self._step = Env.reset, Env.step

    def __enter__(self):
        clock = self

        def timed(fn):
            def wrapper(env, *a, **k):
                t = time.perf_counter()
                try:
                    return fn(env, *a, **k)
                finally:
                    clock.seconds += time.perf_counter() - t
            return wrapper

        Env.reset, Env.step = timed(self._reset), timed(self._step)
        return self

    def __exit__(self, *exc):
        Env.reset, Env.step = self._reset, self._step


def fed_before(e, k: int) -> int:
    """Tokens fed to the model for turn k before its reply: the whole window prefix on a window's
    first turn, else the previous reply's last token and the observation piece."""
    t = e.turns[k]
    if k == 0 or e.turns[k - 1].window != t.window:
        return t.start + e.window_offset(t.window)
    return t.start - e.turns[k - 1].end + 1


@torch.no_grad()
def raw_loop(model, episodes, chunk: int) -> tuple[float, int]:
    """The same schedule with plain HF calls: per chunk and turn, one left-padded prefill of every active
    row's new tokens into a DynamicCache, then one decoding step per reply token of the longest reply."""
    start, tokens = time.perf_counter(), 0
    vocab = model.config.vocab_size
    for lo in range(0, len(episodes), chunk):
        eps = episodes[lo : lo + chunk]
        cache, mask, alive = DynamicCache(), torch.zeros(len(eps), 0, dtype=torch.long), list(range(len(eps)))
        for k in range(max(len(e.turns) for e in eps)):
            keep = [j for j, i in enumerate(alive) if k < len(eps[i].turns)]
            alive = [alive[j] for j in keep]
            idx = torch.tensor(keep)
            if k:
                cache.batch_select_indices(idx)
                mask = mask[idx]
            new = [fed_before(eps[i], k) for i in alive]
            reply = [eps[i].turns[k].n_tokens for i in alive]
            width = max(new)
            block = torch.zeros(len(alive), width, dtype=torch.long)
            for j, n in enumerate(new):
                block[j, width - n:] = 1
            mask = torch.cat([mask, block], 1)
            model(input_ids=torch.randint(0, vocab, (len(alive), width)), attention_mask=mask, past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
            for _ in range(max(reply) - 1):
                mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=torch.long)], 1)
                model(input_ids=torch.randint(0, vocab, (len(alive), 1)), attention_mask=mask, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
            tokens += sum(new) + sum(r - 1 for r in reply)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(paths.SFT_MODEL), help="policy directory (default models/sft)")
    ap.add_argument("--tasks", default=str(paths.TASKS))
    ap.add_argument("--split", default="test")
    ap.add_argument("--batch", type=int, default=None, help="episodes in lockstep (default: rl rollout_batch)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="bench/results/rollout_speed.json")
    args = ap.parse_args()
    params = load_params()
    seed_everything(params.seed, params.torch_threads)
    p = params.rl.stage(params.rl.final)
    batch = args.batch or p.rollout_batch
    policy = load_policy(args.model)
    tasks = load_split(args.tasks, args.split)
    agent = PolicyAgent(policy, temperature=args.temperature, seed=0, batch_size=batch, decoding=p.decoding,
                        max_reply_tokens=p.max_reply_tokens)
    with EnvClock() as env_clock:
        t = time.perf_counter()
        episodes = run_episodes(agent, tasks, args.tasks, p.max_turns, progress="rollout")
        rollout_s = time.perf_counter() - t
    fed = sum(fed_before(e, k) + e.turns[k].n_tokens - 1 for e in episodes for k in range(len(e.turns)))
    torch.manual_seed(0)
    raw_s, raw_tokens = raw_loop(policy.model, episodes, batch)
    engine_s = rollout_s - env_clock.seconds
    result = {
        "model": args.model, "params": policy.n_params(), "panel": f"{args.tasks}/{args.split}", "episodes": len(episodes),
        "batch": batch, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "turns": sum(len(e.turns) for e in episodes), "generated_tokens": sum(e.n_tokens for e in episodes),
        "tokens_fed": fed, "windows": sum(len(e.windows) for e in episodes),
        "rollout_s": round(rollout_s, 2), "env_s": round(env_clock.seconds, 2),
        "env_share": round(env_clock.seconds / rollout_s, 3),
        "rollout_tokens_per_s": round(fed / rollout_s), "engine_tokens_per_s": round(fed / engine_s),
        "raw_s": round(raw_s, 2), "raw_tokens": raw_tokens, "raw_tokens_per_s": round(raw_tokens / raw_s),
        "overhead_vs_raw": round(engine_s / raw_s - 1, 3), "target_overhead": 0.10,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
