"""Asynchronous RL against synchronous RL: episodes per second of the default RL stage on this machine.

The default recipe (params.yaml rl.defaults and the first RL stage's overrides) from the pipeline's SFT
policy (models/sft) on the data/tasks rl pool, `--iterations` iterations per mode, same seed, run one
after the other in this process (params' torch_threads):

- sync@B:           asynchronous.max_staleness 0 (each iteration plays, then trains), B episodes in
                    lockstep: params' rollout_batch and each `--sync-batches` (is another batch faster?);
- async:            max_staleness 1 with params' asynchronous settings (the next iteration plays while
                    this one trains; correction, proximal policy, chunks of chunk_episodes);
- async_recompute:  the same with `proximal: recompute` (a forward pass before each update);
- async_none:       the same with `correction: none` (PPO's ratio against the behaviour policy);
- async@B:          params' asynchronous settings with chunks of B = params' rollout_batch episodes.

Each mode also reports the seconds the trainer spent taking its episodes (waiting, or playing chunks
nobody had claimed), preparing and updating: synchronous they add up; asynchronous the rollout
process plays beside them.

Writes the episodes per second of every mode, the ratio of async to sync at params' defaults as
`speedup` (issue 23's bar), the ratio over the fastest synchronous batch measured as
`speedup_over_fastest_sync`, and each mode's mean rollout success and mismatch KL to
bench/results/async_speed.json.

At a model shape (`--shape 0.5b --device cuda`, the GPU bench: issue 23 asks for it first whenever a
GPU is there) the policy is bench/gpu_rl.py's random-init Qwen2 of that shape (nothing downloaded) on
FrozenLake tasks, free decoding of `--max-reply-tokens` per turn, rollout worker `thread` (a CUDA
model is not shared between processes), and PPO: random weights win no game, so a group-relative
estimator would have no advantage to train on, while the critic's values give every row one. Only
params' default batch is measured there (`--sync-batches` is for the CPU default).

    python bench/async_speed.py                      # after `dvc repro sft` (or the whole pipeline)
    python bench/async_speed.py --iterations 12 --out bench/results/async_speed.json
    python bench/async_speed.py --shape 0.5b --device cuda --iterations 8   # -> bench/results/async_speed_0.5b_cuda.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from agentkiln import paths
from agentkiln.config import PARAMS_FILE, ComputeParams, RLSection, load_params, read_yaml
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


def run(params, p, pool, staleness: int, correction: str | None = None, policy_fn=None, tasks_dir=paths.TASKS
        ) -> dict:
    seed_everything(params.seed, params.torch_threads)
    if policy_fn is None:  # the pipeline's SFT policy and its frozen reference
        policy = load_policy(paths.SFT_MODEL, compute=params.compute)
        ref = copy.deepcopy(policy)
    else:  # a model shape: the same random weights for every mode, no reference (kl_coef 0)
        policy, ref = policy_fn(), None
    a = p.asynchronous.model_copy(update={"max_staleness": staleness, "correction": correction or p.asynchronous.correction})
    q = p.model_copy(update={"asynchronous": a, "checkpoint_every": 0})
    with Clock() as clock:
        start = time.perf_counter()
        hist = trainer.train_rl(policy, ref, pool, tasks_dir, q, seed=params.seed)
        if policy.device.type == "cuda":
            torch.cuda.synchronize(policy.device)
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=12, help="RL iterations per mode (default: the stage's 12)")
    ap.add_argument("--sync-batches", default="16,32",
                    help="other rollout_batch values the synchronous mode is measured at (comma-separated)")
    ap.add_argument("--shape", default="pipeline", choices=["pipeline", "tiny", "0.5b", "1.5b"],
                    help="pipeline: models/sft on the rl pool (default); a shape: bench/gpu_rl.py's random-init Qwen2")
    ap.add_argument("--device", default="auto", help="with --shape: auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="with --shape")
    ap.add_argument("--tasks-per-iter", type=int, default=8, help="with --shape: FrozenLake tasks per iteration")
    ap.add_argument("--max-reply-tokens", type=int, default=32, help="with --shape: tokens per reply (free decoding)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/async_speed.json, or async_speed_<shape>_<device>.json)")
    args = ap.parse_args(argv)
    if args.shape != "pipeline":
        return at_shape(args)

    params = load_params()
    stage = next(iter(params.rl.stages))
    p = params.rl.stage(stage).model_copy(update={"iterations": args.iterations, "episode_budget": None})
    pool = load_split(paths.TASKS, "rl")
    results = {"model": paths.SFT_MODEL.as_posix(), "stage": stage, "threads": params.torch_threads,
               "machine": f"{platform.machine()} {platform.processor()}".strip(), "cpus": os.cpu_count(),
               "device": "cuda" if torch.cuda.is_available() and params.compute.device != "cpu" else "cpu",
               "worker": p.asynchronous.worker, "episodes_per_iteration": p.tasks_per_iter * p.group_size, "modes": {}}
    a = p.asynchronous
    results["asynchronous"] = {"correction": a.correction, "proximal": a.proximal, "chunk_episodes": a.chunk_episodes,
                               "worker": a.worker, "processes": a.processes}
    base = f"sync@{p.rollout_batch}"
    modes = [(base, p, 0, None)]
    modes += [(f"sync@{b}", p.model_copy(update={"rollout_batch": b}), 0, None)
              for b in dict.fromkeys(int(x) for x in args.sync_batches.split(",") if x) if b != p.rollout_batch]
    modes += [("async", p, 1, None),
              ("async_recompute", p.model_copy(update={"asynchronous": a.model_copy(update={"proximal": "recompute"})}), 1, None),
              ("async_none", p, 1, "none"),
              (f"async@{p.rollout_batch}", p.model_copy(update={"asynchronous": a.model_copy(update={"chunk_episodes": None})}), 1, None)]
    for name, q, staleness, correction in modes:
        results["modes"][name] = r = run(params, q, pool, staleness, correction)
        print(f"{name}: {r['episodes']} episodes in {r['seconds']} s = {r['episodes_per_s']} episodes/s", flush=True)
    eps = {name: m["episodes_per_s"] for name, m in results["modes"].items()}
    fastest = max((n for n in eps if n.startswith("sync")), key=eps.get)
    results["speedup"] = round(eps["async"] / eps[base], 3)  # params' defaults, staleness 1
    results["fastest_sync"] = fastest
    results["speedup_over_fastest_sync"] = round(eps["async"] / eps[fastest], 3)
    results["target"] = 1.3
    out = Path(args.out or "bench/results/async_speed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"speedup {results['speedup']}x at params' defaults (async over {base}); {results['speedup_over_fastest_sync']}x "
          f"over the fastest synchronous batch measured ({fastest}); target {results['target']}x; wrote {out}")


def _gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_rl", Path(__file__).with_name("gpu_rl.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def at_shape(args) -> None:
    """Sync against async at a model shape on a device (see the module's docstring)."""
    gpu = _gpu_bench()
    # params.yaml's seed and RL section alone: the whole file's validation resolves every family's
    # generator (textworld for cooking), which a GPU machine need not have installed
    raw = read_yaml(Path(PARAMS_FILE).read_text())
    params = SimpleNamespace(seed=raw.get("seed", 0), torch_threads=raw.get("torch_threads"),
                             rl=RLSection(**raw.get("rl", {})))
    compute = ComputeParams(device=args.device, dtype=args.dtype, attn_implementation="sdpa")
    stage = next(iter(params.rl.stages))
    base = params.rl.stage(stage)
    p = base.model_copy(update={
        "algorithm": "ppo", "iterations": args.iterations, "episode_budget": None, "tasks_per_iter": args.tasks_per_iter,
        "max_turns": 4, "max_reply_tokens": args.max_reply_tokens, "decoding": {"default": "free"}, "kl_coef": 0.0,
        "mix": {},  # its own pool of one type: the pipeline stage's mix names the pipeline pool's types
        "asynchronous": base.asynchronous.model_copy(update={"worker": "thread", "chunk_episodes": None})})
    with tempfile.TemporaryDirectory(prefix="agentkiln-async-bench-") as tmp:
        tasks_dir = Path(tmp) / "tasks"
        n = args.tasks_per_iter * args.iterations
        pool = gpu.synthesize_tasks("gym-toytext", n, seed=3, level="easy", out_dir=tasks_dir, game="frozenlake")

        start = gpu.build_policy(args.shape, pool, tasks_dir, Path(tmp) / "model", compute, 2048, 1000)
        device, n_params = start.device, sum(x.numel() for x in start.model.parameters())

        def policy_fn():  # every mode from the same random weights
            return copy.deepcopy(start)

        results = {"shape": args.shape, "params": n_params, "dtype": args.dtype, "algorithm": p.algorithm,
                   "worker": "thread", "machine": gpu.machine(device), "episodes_per_iteration": p.tasks_per_iter * p.group_size,
                   "rollout_batch": p.rollout_batch, "max_turns": p.max_turns, "max_reply_tokens": p.max_reply_tokens,
                   "modes": {}}
        if device.type == "cuda":  # a first synchronous run warms the GPU up (context, kernels), unreported
            run(params, p.model_copy(update={"iterations": 1}), pool, 0, None, policy_fn, tasks_dir)
        for mode, staleness, correction in (("sync", 0, None), ("async", 1, None), ("async_none", 1, "none")):
            results["modes"][mode] = r = run(params, p, pool, staleness, correction, policy_fn, tasks_dir)
            print(f"{mode}: {r['episodes']} episodes in {r['seconds']} s = {r['episodes_per_s']} episodes/s "
                  f"(take {r['phase_seconds']['take']} s, prepare {r['phase_seconds']['prepare']} s, "
                  f"update {r['phase_seconds']['update']} s)", flush=True)
    eps = {m: r["episodes_per_s"] for m, r in results["modes"].items()}
    results["speedup"] = round(eps["async"] / eps["sync"], 3)
    results["speedup_no_recompute"] = round(eps["async_none"] / eps["sync"], 3)
    results["target"] = 1.3
    out = Path(args.out or f"bench/results/async_speed_{args.shape}_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"speedup {results['speedup']}x (no recompute {results['speedup_no_recompute']}x) at the {args.shape} shape "
          f"on {results['machine']['device_name']}; wrote {out}")


if __name__ == "__main__":
    main()
