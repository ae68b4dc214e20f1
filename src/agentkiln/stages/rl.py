"""RL on its own pool of tasks, starting from the SFT policy, which also serves as KL reference."""

from __future__ import annotations

import csv
from pathlib import Path

from agentkiln.config import Params
from agentkiln.policy import load_policy, save_policy
from agentkiln.stages.common import load_split
from agentkiln.trainers.rl import greedy_success, train_rl


def run_rl(params: Params, tasks_dir: Path, sft_dir: Path, out_dir: Path, curve_csv: Path, log=None) -> dict:
    policy, ref = load_policy(sft_dir), load_policy(sft_dir)
    pool = load_split(tasks_dir, "rl")
    before = greedy_success(policy, pool, tasks_dir, params.rl.max_turns, "rl pool (before)")
    history = train_rl(policy, ref, pool, tasks_dir, params.rl, seed=params.seed, log=log)
    after = greedy_success(policy, pool, tasks_dir, params.rl.max_turns, "rl pool (after)")
    save_policy(policy, out_dir)
    curve_csv.parent.mkdir(parents=True, exist_ok=True)
    with curve_csv.open("w", newline="") as f:
        cols = sorted({k for row in history for k in row} - {"iteration"})
        w = csv.DictWriter(f, fieldnames=["iteration", *cols])
        w.writeheader()
        for row in history:
            w.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    return {
        "pool_success_before": before,
        "pool_success_after": after,
        "pool_size": len(pool),
        "iterations": params.rl.iterations,
        "episodes": params.rl.iterations * params.rl.tasks_per_iter * params.rl.group_size,
    }
