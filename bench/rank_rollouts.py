"""RL on DeepSpeed ranks: rollouts played by rank 0 alone against rollouts spread over the ranks.

The default RL stage (params.yaml rl.defaults and the first RL stage's overrides) from the pipeline's
SFT policy (models/sft) on the data/tasks rl pool, `--iterations` synchronous iterations per mode, on
`--ranks` ZeRO-2 ranks on this machine (on CPU: gloo, params' torch_threads split between the ranks),
the same seed in every mode:

- rank0:   `compute.deepspeed.spread_rollouts: false`: rank 0 plays each round while the others wait;
- spread:  every rank plays its chunks of each round (trainers.rank_rounds) at `rl.rollout_batch`
           (tasks_per_iter x group_size) / ranks, so each rank has one chunk; rank0 is run at that
           batch too, so the two differ only in who plays.

With `--staleness k` (k >= 1) both modes are asynchronous at params' `rl.asynchronous` settings
(chunks of `chunk_episodes`): rank0 plays every flight (its rollout processes and trainer), spread
deals each flight launched ahead over the ranks (trainers.inflight.RankFlights); the same chunks and
seeds, so the same episodes, and the whole loop is the like-for-like figure
(bench/results/rank_rollouts_async.json).

Each mode's seconds are the training loop's on rank 0 (`train_rl`, from its first rollout to its last
update: the ranks' start-up and the final save are left out), with the seconds rank 0 spent taking
its episodes (playing, or waiting for the other ranks' chunks), preparing and updating. Writes each
mode's episodes per second, of the whole loop and of its rollout phase alone, and the ratios as
`speedup` and `rollout_speedup` to bench/results/rank_rollouts.json. The two modes train on different
episodes (the chunks have seeds of their own), so their updates differ in work (`trained_tokens`):
the rollout phase is the like-for-like figure.

    python bench/rank_rollouts.py                    # after `dvc repro sft` (or the whole pipeline)
    python bench/rank_rollouts.py --iterations 6 --ranks 2 --out bench/results/rank_rollouts.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.policy import load_policy
from agentkiln.policy.model import place
from agentkiln.seeding import seed_everything
from agentkiln.servers import free_port
from agentkiln.stages.common import load_split
from agentkiln.trainers import distributed
from agentkiln.trainers.inflight import InFlight
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.rl import spreads


def timed_rank(rank, job: dict) -> dict | None:
    """A rank of the bench: the RL loop on this rank's engine; rank 0 returns its seconds."""
    policy, ref, p = place(job["policy"], rank.compute), place(job["ref"], rank.compute), job["p"]
    took = {"take": 0.0, "prepare": 0.0, "update": 0.0}

    def timed(name, real):  # rank 0's time getting its episodes (playing or waiting), preparing, updating
        def wrapper(*args, **kw):
            start = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                took[name] += time.perf_counter() - start
        return wrapper

    InFlight.take = timed("take", InFlight.take)
    trainer.prepare = timed("prepare", trainer.prepare)
    trainer.update = timed("update", trainer.update)
    start = time.perf_counter()
    history = trainer.train_rl(policy, ref, job["pool"], job["tasks_dir"], p, job["seed"],
                       make_engine=distributed.RankFactory(rank), spread=spreads(p, rank.compute))
    seconds = time.perf_counter() - start
    if not rank.main:
        return None
    return {"seconds": round(seconds, 2), "phase_seconds": {k: round(v, 2) for k, v in took.items()},
            "episodes": history[-1]["episodes"],
            "episodes_per_s": round(history[-1]["episodes"] / seconds, 3),
            "ranks_playing": sorted({h.get("rollout/ranks_playing", 1) for h in history}),
            "rollout_success": round(sum(h["success"] for h in history) / len(history), 4),
            "trained_tokens": sum(h.get("trained_tokens", 0) for h in history),
            "episode_tokens_mean": round(sum(h["episode_tokens"] for h in history) / len(history), 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6, help="RL iterations per mode (default 6)")
    ap.add_argument("--ranks", type=int, default=2, help="DeepSpeed ranks (default 2)")
    ap.add_argument("--staleness", type=int, default=0,
                    help="0: synchronous rounds (default); k >= 1: asynchronous flights at max_staleness k")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/rank_rollouts.json, "
                    "with --staleness bench/results/rank_rollouts_async.json)")
    args = ap.parse_args(argv)
    args.out = args.out or f"bench/results/rank_rollouts{'_async' if args.staleness else ''}.json"

    params = load_params()
    stage = next(iter(params.rl.stages))
    base = params.rl.stage(stage)
    batch = max(base.group_size, base.tasks_per_iter * base.group_size // args.ranks)
    p = base.model_copy(update={"iterations": args.iterations, "episode_budget": None, "checkpoint_every": 0,
                                "rollout_batch": batch, "log_episodes": 0,
                                "asynchronous": base.asynchronous.model_copy(update={"max_staleness": args.staleness})})
    pool = load_split(paths.TASKS, "rl")
    seed_everything(params.seed, params.torch_threads)
    start = load_policy(paths.SFT_MODEL, compute=distributed.parent_compute(params.compute))
    results = {"model": paths.SFT_MODEL.as_posix(), "stage": stage, "threads": params.torch_threads,
               "ranks": args.ranks, "machine": f"{platform.machine()} {platform.processor()}".strip(),
               "cpus": os.cpu_count(), "episodes_per_iteration": p.tasks_per_iter * p.group_size,
               "rollout_batch": batch, "iterations": args.iterations, "asynchronous": p.asynchronous.model_dump(),
               "modes": {}}
    for mode, spread in (("rank0", False), ("spread", True)):
        ds = params.compute.deepspeed.model_copy(update={"num_procs": args.ranks, "spread_rollouts": spread,
                                                         "master_port": free_port()})
        compute = params.compute.model_copy(update={"backend": "deepspeed", "deepspeed": ds})
        job = {"policy": copy.deepcopy(start), "ref": copy.deepcopy(start), "pool": pool, "tasks_dir": paths.TASKS,
               "p": p, "seed": params.seed}
        results["modes"][mode] = r = distributed.launch(timed_rank, job, compute)
        print(f"{mode}: {r['episodes']} episodes in {r['seconds']} s = {r['episodes_per_s']} episodes/s "
              f"(rank 0's phases: {r['phase_seconds']} s; ranks playing: {r['ranks_playing']})")
    modes = results["modes"]
    for r in modes.values():  # the rollout phase alone (the update's work differs with the episodes sampled)
        r["rollout_episodes_per_s"] = round(r["episodes"] / r["phase_seconds"]["take"], 3)
    results["speedup"] = round(modes["spread"]["episodes_per_s"] / modes["rank0"]["episodes_per_s"], 3)
    results["rollout_speedup"] = round(modes["spread"]["rollout_episodes_per_s"] / modes["rank0"]["rollout_episodes_per_s"], 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"spread over {args.ranks} ranks: rollouts {results['rollout_speedup']}x, whole loop {results['speedup']}x "
          f"rank 0 alone; wrote {out}")


if __name__ == "__main__":
    main()
