"""Which SFT is better per minute for a pretrained model on a CPU: the whole model, LoRA adapters, or the
top k decoder layers (`top_layers`).

Each mode trains models/base (the profile's base model, e.g. SmolLM2-135M-Instruct) for one epoch on the
same SFT episodes (the profile's data; `--clean` / `--recovery` scale it down), with the profile's
optimizer settings (LoRA at 10x the learning rate, as its adapters start at zero), then plays the test
panel greedily, once per seed (the seed orders the batches and draws LoRA's adapters). Written per mode
and seed: wall time of training, trained tokens/s, test success (per task type) and success per training
minute; per mode over the seeds: success with its 95% bootstrap CI over seeds and tasks, and against the
first mode the paired difference in success (same seeds, same tasks) with its CI.

    python bench/sft_modes.py --params params.yaml      # after applying profiles/smollm2.yaml and dvc repro base
    python bench/sft_modes.py --clean 0.5 --recovery 0 --modes full lora top15 --seeds 0 1 2 --out bench/results/sft_modes.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--tasks", default="data/tasks")
    ap.add_argument("--clean", type=float, default=None, help="sft.data.clean for every mode (default: the params')")
    ap.add_argument("--recovery", type=float, default=None, help="sft.data.recovery for every mode")
    ap.add_argument("--modes", nargs="+", default=["full", "lora", "top15"], help="full | lora | topK")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds (3 for CIs that mean something)")
    ap.add_argument("--out", default="bench/results/sft_modes.json")
    args = ap.parse_args()

    from agentkiln.config import load_params
    from agentkiln.panels import load_panel
    from agentkiln.policy import load_policy
    from agentkiln.policy.device import cpu_name
    from agentkiln.rollout.agents import PolicyAgent
    from agentkiln.rollout.engine import run_episodes
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.sft import run_sft
    from agentkiln.stats import bootstrap_mean, paired_difference

    params = load_params(args.params)
    data = params.sft.data.model_copy(update={k: v for k, v in (("clean", args.clean), ("recovery", args.recovery))
                                              if v is not None})
    test = load_panel(args.tasks, "test")
    out: dict = {"bench": "sft_modes", "base": args.base, "cpu": cpu_name(), "cores": os.cpu_count(),
                 "torch": torch.__version__, "threads": params.torch_threads, "dtype": params.compute.dtype,
                 "data": data.model_dump(), "seeds": args.seeds, "modes": {}}
    outcomes: dict[str, list[list[int]]] = {}
    for mode in args.modes:
        sft = params.sft.model_copy(update={"data": data, "top_layers": None})
        if mode == "lora":
            sft = sft.model_copy(update={"lora": sft.lora.model_copy(update={"enabled": True}), "lr": sft.lr * 10})
        elif mode.startswith("top"):
            sft = sft.model_copy(update={"top_layers": int(mode[3:])})
        elif mode != "full":
            raise SystemExit(f"--modes: {mode!r} is not full, lora or topK")
        runs, outcomes[mode] = [], []
        for seed in args.seeds:
            p = params.model_copy(update={"sft": sft, "seed": seed})
            seed_everything(p.seed, p.torch_threads)
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                metrics = run_sft(p, Path(args.tasks), Path(tmp) / "sft", base_dir=Path(args.base))
                seconds = time.perf_counter() - start
                policy = load_policy(Path(tmp) / "sft", compute=p.compute)
                episodes = run_episodes(PolicyAgent(policy, greedy=True, batch_size=p.evaluate.batch_size), test,
                                        args.tasks, None)
            by_task = {ep.task_id: int(ep.won) for ep in episodes}
            outcomes[mode].append([by_task[t.task_id] for t in test])
            won = collections.defaultdict(list)
            for ep in episodes:
                won[ep.task_type].append(ep.won)
            success = sum(ep.won for ep in episodes) / len(episodes)
            runs.append({"seed": seed, "train_s": round(seconds, 1), "tokens": metrics["n_tokens"],
                         "tokens_per_s": round(metrics["n_tokens"] / seconds), "test_success": round(success, 4),
                         "by_task_type": {k: round(sum(v) / len(v), 4) for k, v in sorted(won.items())},
                         "success_per_train_minute": round(success / (seconds / 60), 4)})
            print(mode, json.dumps(runs[-1]), flush=True)
            del policy
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        m, lo, hi = bootstrap_mean(outcomes[mode])
        minutes = sum(r["train_s"] for r in runs) / len(runs) / 60
        out["modes"][mode] = {"lr": sft.lr, "test_success": round(m, 4), "ci": [round(lo, 4), round(hi, 4)],
                              "train_s": round(60 * minutes, 1), "success_per_train_minute": round(m / minutes, 4),
                              "runs": runs}
        first = args.modes[0]
        if mode != first:
            d, lo, hi = paired_difference(outcomes[mode], outcomes[first])
            out["modes"][mode][f"vs_{first}"] = {"diff": round(d, 4), "ci": [round(lo, 4), round(hi, 4)]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")  # after each mode: a stopped run keeps them


if __name__ == "__main__":
    main()
