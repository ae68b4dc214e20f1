"""The findings: every arm x seed that a claim of params.yaml `findings` names runs once (an arm shared
by claims too), then the report (agentkiln.evaluate.findings_report) compares each claim's two arms.

One run: the arm's starting policy (models/sft; models/sft's architecture and tokenizer with fresh
weights; or an SFT the arm trains itself), its RL stages, then every panel played greedily (0/1 per
task). Each finished run is cached as JSON under reports/findings/runs/, named by a fingerprint of
everything that decides its outcome (the resolved stages and SFT, seed, panels, evaluation and compute
settings, the starting model and the task manifests): an interrupted run resumes, and adding a claim
trains only its new arms. Runs are self-contained (each loads its own tasks and model), one torch
thread each whatever `workers` is, so a run's outcome does not depend on how many run beside it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from agentkiln import fanout, paths
from agentkiln.config import Params
from agentkiln.errors import UserError
from agentkiln.evaluate.findings_report import summarize, write_reports
from agentkiln.policy import load_policy
from agentkiln.policy.device import cpu_name
from agentkiln.policy.model import MANIFEST_FILE, Policy, place
from agentkiln.stages.ablation import play_panel, train_stages
from agentkiln.seeding import seed_everything
from agentkiln.stages.common import load_split
from agentkiln.stages.sft import run_sft
from agentkiln.trainers.checkpoint import fingerprint

RESULT_VERSION = 1  # bump when a cached run's JSON changes shape: older runs are then re-run


def arms_in_use(params: Params) -> list[str]:
    """The arms the claims name, each once, in the order they first appear."""
    return list(dict.fromkeys(a for c in params.findings.claims for a in (c.a, c.b)))


def resolved(params: Params, arm: str) -> dict:
    """What the arm runs, fully spelled out: its init, its SFT section (sft_arm) and its RL stages."""
    spec = params.findings.arms[arm]
    sft = params.findings_sft(arm).model_dump() if spec.init == "sft_arm" else None
    return {"init": spec.init, "sft": sft, "stages": [p.model_dump() for p in params.findings_stages(arm)]}


def run_key(params: Params, arm: str, seed: int, tasks_dir: Path, sft_dir: Path) -> str:
    """The cache key of one run: a change to anything its outcome depends on gives another key."""
    spec = params.findings.arms[arm]
    splits = ["rl", *params.findings.panels] + (["sft"] if spec.init == "sft_arm" else [])
    files = [Path(tasks_dir) / s / "manifest.json" for s in splits]  # sealed: the tasks and their game files
    if spec.init == "sft_arm":
        files.append(Path(tasks_dir) / "expert_trajectories.parquet")
        if (base := base_dir(sft_dir) / MANIFEST_FILE).is_file():  # the model its SFT starts from
            files.append(base)
    elif spec.init == "base":
        files.append(base_dir(sft_dir) / MANIFEST_FILE)
    else:
        files.append(Path(sft_dir) / MANIFEST_FILE)  # the saved model's files and their sha256
    # a DeepSpeed-only setting cannot change a one-process run: left out, so adding one keeps the cache
    compute = params.compute.model_dump(exclude={"deepspeed": {"spread_rollouts"}}
                                        if params.compute.backend == "single" else None)
    threads = run_threads(params)  # one thread (side by side): the key runs have always had
    return fingerprint(RESULT_VERSION, resolved(params, arm), seed, params.findings.panels,
                       params.evaluate.model_dump(), compute, *([threads] if threads > 1 else []), files=files)[:16]


def run_path(runs_dir: Path, arm: str, seed: int, key: str) -> Path:
    return Path(runs_dir) / f"{arm}-s{seed}-{key}.json"


def base_dir(sft_dir: Path) -> Path:
    """The base stage's model beside the pipeline's models/sft (models/base)."""
    return Path(sft_dir).parent / "base"


def reinitialised(policy: Policy, seed: int, compute) -> Policy:
    """The same architecture and tokenizer with freshly drawn weights (drawn on the CPU: the same
    seed gives the same model on every device)."""
    torch.manual_seed(seed)
    policy.model = type(policy.model)(policy.model.config)
    return place(policy, compute)


def starting_policy(params: Params, arm: str, seed: int, tasks_dir: Path, sft_dir: Path) -> tuple[Policy, dict | None]:
    """The arm's policy before RL, and its own SFT's metrics (init sft_arm) or None."""
    init = params.findings.arms[arm].init
    if init == "sft":
        return load_policy(sft_dir, compute=params.compute), None
    if init == "base":  # RL with no SFT
        return load_policy(base_dir(sft_dir), compute=params.compute), None
    if init == "scratch":
        return reinitialised(load_policy(sft_dir, compute=params.compute), seed, params.compute), None
    # the arm's own SFT, seeded by the run's seed (scratch weights, batch order)
    own = params.model_copy(update={"sft": params.findings_sft(arm), "seed": seed})
    base = base_dir(sft_dir)
    if params.sft.model.source == "scratch":  # the seed draws the scratch weights: built here, seeded by the run
        base = None
    with tempfile.TemporaryDirectory(prefix=f"findings-{arm}-s{seed}-") as tmp:
        metrics = run_sft(own, tasks_dir, Path(tmp) / "sft", base_dir=base if base and base.is_dir() else None)
        return load_policy(Path(tmp) / "sft", compute=params.compute), metrics


def run_one(params: Params, arm: str, seed: int, tasks_dir: Path, sft_dir: Path) -> dict:
    """One arm x seed: its starting policy, its RL stages, then every panel greedily. Self-contained,
    so it can run in a worker process; one torch thread (restored after)."""
    threads = torch.get_num_threads()
    seed_everything(seed, run_threads(params))  # whatever ran before in this process, the same run gives the same outcomes
    start = time.perf_counter()
    try:
        policy, sft_metrics = starting_policy(params, arm, seed, tasks_dir, sft_dir)
        curve = train_stages(policy, params.findings_stages(arm), seed, load_split(tasks_dir, "rl"), tasks_dir)
        won, task_ids = {}, {}
        for panel in params.findings.panels:
            tasks = load_split(tasks_dir, panel)
            won[panel] = play_panel(policy, tasks, tasks_dir, params.evaluate, f"findings: {arm} seed {seed} on {panel}")
            task_ids[panel] = [t.task_id for t in tasks]
    finally:
        torch.set_num_threads(threads)
    return {"arm": arm, "seed": seed, "outcomes": won, "task_ids": task_ids, "curve": curve, "sft": sft_metrics,
            "episodes": curve[-1]["episodes"] if curve else 0, "seconds": round(time.perf_counter() - start, 1),
            "machine": machine(params)}


def run_threads(params: Params) -> int:
    """Torch threads of one run: 1 when runs go side by side (`workers` > 1), else `torch_threads` (one run
    of a 135M model at a time, on every core). Part of a run's key: threads change float rounding."""
    return 1 if params.findings.workers > 1 else params.torch_threads


def machine(params: Params) -> str:
    """Where a run ran, in words: CPU or GPU, cores, threads, torch."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and params.compute.device != "cpu" \
        else cpu_name()
    n = run_threads(params)
    return f"{device}, {os.cpu_count()} cores, {n} torch thread{'s' if n > 1 else ''} per run, torch {torch.__version__}"


def _finish(result: dict, path: Path, say: Callable[[str], None], done: int, total: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a killed run never leaves half a result that a resume would trust
    scores = ", ".join(f"{p} {sum(w) / len(w):.3f}" for p, w in result["outcomes"].items())
    say(f"findings: [{done}/{total}] {result['arm']} seed {result['seed']}: {scores} ({result['seconds']:.0f} s)")


@fanout.in_session
def run_findings(params: Params, tasks_dir: Path, out_dir: Path, sft_dir: Path = paths.SFT_MODEL,
                 run: Callable[..., dict] = run_one, say: Callable[[str], None] = print,
                 only: list[str] | None = None) -> dict:
    """Run every arm x seed the claims need that out_dir/runs does not hold yet (`findings.workers` at a
    time; on Ray as many as the cluster has CPUs), then write out_dir/findings.{json,md,png}. `run`
    (module-level, so worker processes can import it) trains and plays one arm x seed. `only`: these
    claims (ids) and their arms alone; the report says so (`only`), and publishing it replaces those
    claims of the published ones. Returns the report's content."""
    if only:
        params = only_claims(params, only)
    f = params.findings
    if not f.claims:
        raise ValueError("findings.claims is empty: nothing to reproduce (params.yaml findings)")
    arms, runs_dir = arms_in_use(params), Path(out_dir) / "runs"
    jobs = {(arm, s): run_path(runs_dir, arm, s, run_key(params, arm, s, tasks_dir, sft_dir)) for arm in arms for s in f.seeds}
    results = {job: json.loads(p.read_text()) for job, p in jobs.items() if p.is_file()}
    # an arm that trains nothing plays a fixed model greedily: every seed's outcome is its first seed's
    fixed = {arm for arm in arms if untrained(params, arm)}
    todo = [job for job in jobs if job not in results and (job[0] not in fixed or job[1] == f.seeds[0])]
    say(f"findings: {len(jobs)} runs ({len(arms)} arms x {len(f.seeds)} seeds), {len(results)} cached, "
        f"{len(todo)} to run")
    if f.workers == 1 and not fanout.active():
        for job in todo:
            results[job] = run(params, *job, tasks_dir, sft_dir)
            _finish(results[job], jobs[job], say, len(results), len(jobs))
    elif todo:
        # spawn: fresh interpreters, no forked torch thread pools; runs are self-contained either way
        pool = fanout.RayExecutor() if fanout.active() else ProcessPoolExecutor(
            f.workers, mp_context=multiprocessing.get_context("spawn"))
        with pool as ex:
            futures = {ex.submit(run, params, *job, tasks_dir, sft_dir): job for job in todo}
            for fut in as_completed(futures):
                job = futures[fut]
                results[job] = fut.result()
                _finish(results[job], jobs[job], say, len(results), len(jobs))
    for arm in fixed:
        for seed in f.seeds[1:]:
            if (arm, seed) not in results:
                results[arm, seed] = results[arm, f.seeds[0]] | {"seed": seed, "seconds": 0.0, "same_as_seed": f.seeds[0]}
                _finish(results[arm, seed], jobs[arm, seed], say, len(results), len(jobs))
    result = report(params, {arm: {s: results[arm, s] for s in f.seeds} for arm in arms}, tasks_dir)
    if only:
        result["only"] = [c.id for c in f.claims]
    write_reports(result, out_dir)
    return result


def only_claims(params: Params, ids: list[str]) -> Params:
    """params with findings.claims narrowed to `ids` (in params' order); an unknown id is a UserError."""
    known = [c.id for c in params.findings.claims]
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise UserError(f"findings --claims: no claim {', '.join(map(repr, unknown))} in params.yaml findings.claims "
                        f"(its claims: {', '.join(known)})")
    claims = [c for c in params.findings.claims if c.id in ids]
    return params.model_copy(update={"findings": params.findings.model_copy(update={"claims": claims})})


def untrained(params: Params, arm: str) -> bool:
    """An arm that trains nothing (no RL stage, a saved starting model): its greedy outcome has no seed."""
    spec = params.findings.arms[arm]
    return not spec.stages and spec.init in ("sft", "base")


def report(params: Params, runs: dict[str, dict[int, dict]], tasks_dir: Path) -> dict:
    """The report's content from finished runs: claims (deterministic), arms and `meta` (timings)."""
    f = params.findings
    panels = {}
    for panel in f.panels:
        tasks = load_split(tasks_dir, panel)
        ids = [t.task_id for t in tasks]
        for arm, by_seed in runs.items():
            for s, r in by_seed.items():
                if r["task_ids"][panel] != ids:
                    raise ValueError(f"findings: run {arm} seed {s} played another {panel} panel than data/tasks "
                                     "holds; remove reports/findings/runs and run again")
        panels[panel] = [t.task_type or t.family for t in tasks]
    arms = {arm: {"spec": f.arms[arm].model_dump(), "budget": params.findings_budget(arm)} for arm in runs}
    claims = summarize([c.model_dump() for c in f.claims], arms, runs, f.seeds, panels,
                       params.evaluate.confidence, params.evaluate.n_boot)
    first = f.panels[0]
    seconds = {arm: [by_seed[s]["seconds"] for s in f.seeds] for arm, by_seed in runs.items()}
    machines = sorted({r["machine"] for by_seed in runs.values() for r in by_seed.values()})
    return {
        "profile": f.profile, "claims": [c | {"profile": f.profile} for c in claims], "arms": arms, "seeds": f.seeds,
        "panels": f.panels, "base": f.base,
        "confidence": params.evaluate.confidence, "n_boot": params.evaluate.n_boot,
        "per_seed": {arm: [round(sum(by_seed[s]["outcomes"][first]) / len(by_seed[s]["outcomes"][first]), 4)
                           for s in f.seeds] for arm, by_seed in runs.items()},
        "meta": {"machine": "; ".join(machines), "runs": sum(len(v) for v in seconds.values()),
                 "minutes": {arm: round(sum(v) / len(v) / 60, 2) for arm, v in seconds.items()},
                 "total_minutes": round(sum(map(sum, seconds.values())) / 60, 2)},
    }
