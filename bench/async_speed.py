"""Asynchronous RL against synchronous RL: episodes per second of the default RL stage on this machine.

The default recipe (params.yaml rl.defaults and the first RL stage's overrides) from the pipeline's SFT
policy (models/sft) on the data/tasks rl pool, `--iterations` iterations per mode, same seed, run one
after the other in this process (params' torch_threads):

- sync:        asynchronous.max_staleness 0 (each iteration plays, then trains);
- async:       max_staleness 1 with params' correction (the next iteration plays while this one trains);
- async_none:  max_staleness 1, correction none (no recomputation pass before the update).

each at params' rollout_batch and at `--small-batch` episodes per lockstep batch (an asynchronous
flight's chunk: the rollout process and the trainer share them). Each mode also reports the seconds
the trainer spent taking its episodes (waiting, or playing chunks nobody had claimed), preparing and
updating: synchronous they add up; asynchronous the rollout process plays beside them.

Writes the episodes per second of every mode, the ratio of async to sync at params' defaults as
`speedup`, the best asynchronous ratio over the synchronous run at the same batch as `best`, and each
mode's mean rollout success and mismatch KL to bench/results/async_speed.json.

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
from agentkiln.trainers.inflight import InFlight


class Clock:
    """Seconds spent in the trainer's phases (wrapping its functions): taking the iteration's episodes
    (waiting for them, or playing them), preparing and updating."""

    def __init__(self):
        self.seconds = {"take": 0.0, "prepare": 0.0, "update": 0.0}
        self.real = {"take": (InFlight, InFlight.take), "prepare": (trainer, trainer.prepare),
                     "update": (trainer, trainer.update)}

    def __enter__(self):
        for name, (owner, fn) in self.real.items():
            setattr(owner, name, self._timed(name, fn))
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
        for name, (owner, fn) in self.real.items():
            setattr(owner, name, fn)


def run(params, p, pool, staleness: int, correction: str | None = None) -> dict:
    seed_everything(params.seed, params.torch_threads)
    policy = load_policy(paths.SFT_MODEL, compute=params.compute)
    ref = copy.deepcopy(policy)
    a = p.asynchronous.model_copy(update={"max_staleness": staleness, "correction": correction or p.asynchronous.correction})
    q = p.model_copy(update={"asynchronous": a, "checkpoint_every": 0})
    with Clock() as clock:
        start = time.perf_counter()
        hist = trainer.train_rl(policy, ref, pool, paths.TASKS, q, seed=params.seed)
        seconds = time.perf_counter() - start
    episodes = hist[-1]["episodes"]
    out = {"rollout_batch": q.rollout_batch, "correction": a.correction if staleness else None,
           "iterations": len(hist), "episodes": episodes, "seconds": round(seconds, 2),
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
    ap.add_argument("--small-batch", type=int, default=16,
                    help="the second rollout_batch measured (default 16: two groups per chunk)")
    ap.add_argument("--out", default="bench/results/async_speed.json")
    args = ap.parse_args()

    params = load_params()
    stage = next(iter(params.rl.stages))
    p = params.rl.stage(stage).model_copy(update={"iterations": args.iterations, "episode_budget": None})
    pool = load_split(paths.TASKS, "rl")
    results = {"model": paths.SFT_MODEL.as_posix(), "stage": stage, "threads": params.torch_threads,
               "machine": f"{platform.machine()} {platform.processor()}".strip(), "cpus": os.cpu_count(),
               "device": "cuda" if torch.cuda.is_available() and params.compute.device != "cpu" else "cpu",
               "worker": p.asynchronous.worker, "episodes_per_iteration": p.tasks_per_iter * p.group_size, "modes": {}}
    for batch in dict.fromkeys((p.rollout_batch, args.small_batch)):
        q = p.model_copy(update={"rollout_batch": batch})
        for mode, staleness, correction in (("sync", 0, None), ("async", 1, None), ("async_none", 1, "none")):
            name = f"{mode}@{batch}"
            results["modes"][name] = r = run(params, q, pool, staleness, correction)
            print(f"{name}: {r['episodes']} episodes in {r['seconds']} s = {r['episodes_per_s']} episodes/s")
    modes = results["modes"]
    eps = {name: m["episodes_per_s"] for name, m in modes.items()}
    base = f"sync@{p.rollout_batch}"
    results["speedup"] = round(eps[f"async@{p.rollout_batch}"] / eps[base], 3)  # params' defaults, staleness 1
    best = max((n for n in eps if n.startswith("async")), key=eps.get)
    results["best"] = {"mode": best, "over": base, "speedup": round(eps[best] / eps[base], 3),
                       "over_same_batch": round(eps[best] / eps["sync@" + best.split("@")[1]], 3)}
    results["target"] = 1.3
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"speedup {results['speedup']}x at params' defaults; best {results['best']['mode']} "
          f"{results['best']['speedup']}x over {base} ({results['best']['over_same_batch']}x over sync at its batch); "
          f"target {results['target']}x; wrote {out}")


if __name__ == "__main__":
    main()
