"""Asynchronous RL against synchronous RL: episodes per second of the default RL stage on this machine.

The default recipe (params.yaml rl.defaults and the first RL stage's overrides) from the pipeline's SFT
policy (models/sft) on the data/tasks rl pool, `--iterations` iterations per mode, same seed, run one
after the other in this process with `torch_threads` threads:

- sync:  asynchronous.max_staleness 0 (each iteration plays, then trains);
- async: asynchronous.max_staleness 1 (the next iteration plays on a snapshot while this one trains).

Each mode also reports the seconds spent playing (in the rollout worker) and preparing / updating (on
the trainer's thread): synchronous, they add up; asynchronous, they overlap.

Writes the episodes per second of both, their ratio as `speedup`, the iteration times, and each
mode's mean rollout success and mismatch KL (async) to bench/results/async_speed.json.

    python bench/async_speed.py                      # after `dvc repro sft` (or the whole pipeline)
    python bench/async_speed.py --iterations 12 --out bench/results/async_speed.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.policy import load_policy
from agentkiln.seeding import seed_everything
from agentkiln.stages.common import load_split
from agentkiln.trainers import rl as trainer


class Clock:
    """Seconds spent in the trainer's phases (wrapping its functions): playing episodes (in the worker),
    and preparing + updating (on the trainer's thread)."""

    def __init__(self):
        self.seconds = {"play": 0.0, "prepare": 0.0, "update": 0.0}
        self.real = {name: getattr(trainer, name) for name in self.seconds}

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(trainer, name, self._timed(name, fn))
        return self

    def _timed(self, name, fn):
        def wrapper(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(trainer, name, fn)


def run(params, p, pool, staleness: int) -> dict:
    seed_everything(params.seed, params.torch_threads)
    policy = load_policy(paths.SFT_MODEL, compute=params.compute)
    ref = copy.deepcopy(policy)
    q = p.model_copy(update={"asynchronous": p.asynchronous.model_copy(update={"max_staleness": staleness}),
                             "checkpoint_every": 0})
    with Clock() as clock:
        start = time.perf_counter()
        hist = trainer.train_rl(policy, ref, pool, paths.TASKS, q, seed=params.seed)
        seconds = time.perf_counter() - start
    episodes = hist[-1]["episodes"]
    out = {"iterations": len(hist), "episodes": episodes, "seconds": round(seconds, 2),
           "episodes_per_s": round(episodes / seconds, 3),
           "rollout_success": round(sum(h["success"] for h in hist) / len(hist), 4),
           "phase_seconds": {k: round(v, 2) for k, v in clock.seconds.items()}}
    kl = [h["mismatch/k3_kl"] for h in hist if "mismatch/k3_kl" in h]
    if kl:
        out["mismatch_k3_kl_mean"] = round(sum(kl) / len(kl), 6)
        out["mismatch_k3_kl_max"] = round(max(kl), 6)
        out["staleness"] = sorted({h["async/staleness"] for h in hist})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=12, help="RL iterations per mode (default: the stage's 12)")
    ap.add_argument("--out", default="bench/results/async_speed.json")
    args = ap.parse_args()

    params = load_params()
    stage = next(iter(params.rl.stages))
    p = params.rl.stage(stage).model_copy(update={"iterations": args.iterations, "episode_budget": None})
    pool = load_split(paths.TASKS, "rl")
    results = {"model": paths.SFT_MODEL.as_posix(), "stage": stage, "threads": params.torch_threads,
               "machine": f"{platform.machine()} {platform.processor()}".strip(), "cpus": os.cpu_count(),
               "device": "cuda" if torch.cuda.is_available() and params.compute.device != "cpu" else "cpu",
               "episodes_per_iteration": p.tasks_per_iter * p.group_size}
    for mode, staleness in (("sync", 0), ("async", 1)):
        results[mode] = run(params, p, pool, staleness)
        print(f"{mode}: {results[mode]['episodes']} episodes in {results[mode]['seconds']} s = "
              f"{results[mode]['episodes_per_s']} episodes/s")
    results["speedup"] = round(results["async"]["episodes_per_s"] / results["sync"]["episodes_per_s"], 3)
    results["target"] = 1.3
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"speedup {results['speedup']}x (target {results['target']}x); wrote {out}")


if __name__ == "__main__":
    main()
