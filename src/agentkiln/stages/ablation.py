"""The RL ablation: every arm x seed trains from the same starting policy at the same rollout
budget, then plays the frozen panel greedily; statistics over (seed, task) cells.

    outcomes[arm] : [seeds, tasks] of 0/1        -> success +- 95% CI (bootstrap over seeds and tasks)
    outcomes[arm] - outcomes[baseline]           -> paired difference + CI (same seeds, same tasks)
    outcomes[arm] - outcomes[init]               -> does RL beat its starting point (SFT)?

The starting policy is deterministic under greedy decoding, so it is played once and its outcomes
are repeated per seed for the paired comparisons.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from agentkiln import fanout, paths
from agentkiln.config import Params, RLParams
from agentkiln.evaluate.ablation_report import write_ablation_reports
from agentkiln.evaluate.harness import outcomes, play
from agentkiln.stats import bootstrap_mean, paired_difference
from agentkiln.policy import load_policy
from agentkiln.evaluate.agents import policy_agent
from agentkiln.stages.common import load_split
from agentkiln.trainers.rl import train_rl


def play_panel(policy, panel, tasks_dir: Path, evaluate, desc: str) -> list[int]:
    """Per-task greedy outcomes on the panel, through the evaluation harness."""
    return outcomes(play(policy_agent(policy, evaluate, greedy=True), panel, tasks_dir, evaluate.max_turns,
                         progress=desc))


def train_arm(params: Params, arm: str, seed: int, pool, tasks_dir: Path, init_dir: Path, log=None):
    """Train one arm with one seed: its stages in order, each KL-anchored to the policy it started from.
    Returns (policy, learning curve rows with cumulative episodes)."""
    policy = load_policy(init_dir, compute=params.compute)
    return policy, train_stages(policy, params.ablation_stages(arm), seed, pool, tasks_dir, log=log)


def train_stages(policy, stages: list[RLParams], seed: int, pool, tasks_dir: Path, log=None) -> list[dict]:
    """RL stages in order on `policy` (in place), each KL-anchored to the policy it started from and
    seeded `seed * 1000 + k`, keeping their last weights (train_rl is given no Selector: choosing among
    checkpoints is the pipeline stage's); learning curve rows with cumulative episodes."""
    curve, offset = [], 0
    for k, p in enumerate(stages):
        ref = copy.deepcopy(policy)
        hist = train_rl(policy, ref, pool, tasks_dir, p, seed=seed * 1000 + k, log=log)
        for h in hist:
            curve.append({"stage": k, "iteration": len(curve) + 1, "episodes": offset + h["episodes"],
                          "success": h["success"], "kl": h.get("kl"), "entropy": h.get("entropy"),
                          "zero_var_groups": h["zero_var_groups"]})
        offset = curve[-1]["episodes"] if curve else offset
    return curve


def _report_job(arm: str, seed: int, result: tuple, panel: str, log_run) -> None:
    won, curve, _ = result
    if log_run:
        log_run(arm, seed, {"success": sum(won) / len(won)}, curve)
    print(f"ablation: {arm} seed {seed}: {panel} success {sum(won) / len(won):.3f}")


def summarize(outcomes: dict[str, list[list[int]]], init_outcomes: list[int], baseline: str, init: str,
              confidence: float) -> dict:
    """Per arm: success with CI, and paired differences to the baseline arm and to the starting policy."""
    out = {}
    n_seeds = len(next(iter(outcomes.values())))
    init_rows = [init_outcomes] * n_seeds
    m, lo, hi = bootstrap_mean([init_outcomes], confidence)
    out[init] = {"success": m, "ci_low": lo, "ci_high": hi, "is_init": True}
    for arm, rows in outcomes.items():
        m, lo, hi = bootstrap_mean(rows, confidence)
        d, dlo, dhi = paired_difference(rows, init_rows, confidence)
        row = {"success": m, "ci_low": lo, "ci_high": hi, "per_seed": [sum(r) / len(r) for r in rows],
               f"vs_{init}": {"diff": d, "ci_low": dlo, "ci_high": dhi}}
        if arm != baseline:
            b, blo, bhi = paired_difference(rows, outcomes[baseline], confidence)
            row[f"vs_{baseline}"] = {"diff": b, "ci_low": blo, "ci_high": bhi}
        out[arm] = row
    return out


def run_job(params: Params, arm: str, seed: int, tasks_dir: Path, threads: int | None = None) -> tuple[list[int], list[dict], float]:
    """One arm x seed: train, then play the panel. (outcomes per task, learning curve, seconds).
    Self-contained (loads its own tasks and model), so jobs can run in worker processes."""
    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    a = params.ablation
    pool, panel = load_split(tasks_dir, "rl"), load_split(tasks_dir, a.panel)
    policy, curve = train_arm(params, arm, seed, pool, tasks_dir, paths.model_dir(a.init))
    won = play_panel(policy, panel, tasks_dir, params.evaluate, f"ablation: {arm} seed {seed} on {a.panel}")
    return won, curve, time.perf_counter() - start


@fanout.in_session
def run_ablation(params: Params, tasks_dir: Path, reports_dir: Path, log_run=None) -> dict:
    """Run every arm x seed (`ablation.workers` at a time, one torch thread each when more than one;
    on Ray: tasks of one CPU and one thread each, as many at a time as the cluster has CPUs);
    write reports/ablation.{json,md,png}. `log_run(arm, seed, metrics, curve)` records each run."""
    a = params.ablation
    panel = load_split(tasks_dir, a.panel)
    init_dir = paths.model_dir(a.init)
    init_outcomes = play_panel(load_policy(init_dir, compute=params.compute), panel, tasks_dir, params.evaluate,
                               f"ablation: {a.init} on {a.panel}")
    jobs = [(arm, seed) for arm in a.arms for seed in a.seeds]
    results: dict[tuple[str, int], tuple] = {}
    if a.workers == 1 and not fanout.active():
        for arm, seed in jobs:
            results[arm, seed] = run_job(params, arm, seed, tasks_dir)
            _report_job(arm, seed, results[arm, seed], a.panel, log_run)
    else:
        # spawn: fresh interpreters, no forked torch thread pools; jobs are self-contained either way
        pool = fanout.RayExecutor() if fanout.active() else ProcessPoolExecutor(
            a.workers, mp_context=multiprocessing.get_context("spawn"))
        with pool as ex:
            futures = {ex.submit(run_job, params, arm, seed, tasks_dir, 1): (arm, seed) for arm, seed in jobs}
            for fut in as_completed(futures):
                arm, seed = futures[fut]
                results[arm, seed] = fut.result()
                _report_job(arm, seed, results[arm, seed], a.panel, log_run)
    outcomes = {arm: [results[arm, s][0] for s in a.seeds] for arm in a.arms}
    curves = {arm: [results[arm, s][1] for s in a.seeds] for arm in a.arms}
    seconds = {arm: round(sum(results[arm, s][2] for s in a.seeds), 1) for arm in a.arms}
    result = {
        "panel": a.panel, "n_tasks": len(panel), "seeds": a.seeds, "init": a.init, "baseline": a.baseline,
        "confidence": params.evaluate.confidence, "episode_budget": sum(p.episode_budget for p in params.ablation_stages(a.baseline)),
        "base": a.base, "arms": a.arms,  # each arm's own overrides (of rl.defaults + base)
        "summary": summarize(outcomes, init_outcomes, a.baseline, a.init, params.evaluate.confidence),
        "curves": curves, "seconds": seconds,
        "outcomes": {"init": init_outcomes, **outcomes}, "task_ids": [t.task_id for t in panel],
    }
    reports_dir.mkdir(parents=True, exist_ok=True)
    (reports_dir / "ablation.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    write_ablation_reports(result, reports_dir)
    return result
