"""The synthesize stage: a mixture of task types into seeded, disjoint sft / rl / test (/ ood) splits.

Task i of a split of n tasks gets seed `split.seed * SEED_STRIDE + k * n + i` on its k-th attempt
(seeds never repeat within or across splits). Task types are allotted to a split in proportion to
`mix` (largest remainder), in an order shuffled by `random.Random(split.seed)`. A task enters only
if its expert wins it within `max_expert_steps` (the verification gate) and its content fingerprint
was not admitted before: not in an earlier split (sft, rl, test, ood) nor earlier in the same split.
Everything is decided in task order, whatever order the workers finish in.

Outputs under `out_dir`: `<split>/manifest.json` (tasks, seeds, difficulty, environment versions),
`tasks.parquet` (one row per task, pandera-checked), `expert_trajectories.parquet` (sft and rl only:
the panels' solutions are never training data), `games/` (TextWorld's compiled games), `summary.json`.

`expert_trajectories.parquet` holds one row per step of every episode: each task's `clean` walkthrough
(episode `<task_id>/clean`), then its `recovery` episodes (`<task_id>/recovery-<j>`, mistake steps
flagged in `mistake`) and `alternative` walkthroughs (`<task_id>/alternative-<j>`) that
`synthesize.recovery` asks for (agentkiln.synthesis.recovery; attempts the expert could not win are
dropped, counted in the summary's `extra_dropped`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from agentkiln.config import SPLITS, TRAIN_SPLITS, SynthesizeParams
from agentkiln.panels import seal
from agentkiln.schemas import validate_expert_trajectories, validate_task_table
from agentkiln.synthesis.generate import MAX_RETRIES, SEED_STRIDE, build, env_version, task_seed
from agentkiln.synthesis.recovery import Extras


WORKER_HASH_SEED = "0"  # see synthesize(): same params -> same bytes, whatever the caller's hash seed


def allot(mix: dict[str, float], n: int, seed: int) -> list[str]:
    """Task type of each task: counts proportional to `mix` (largest remainder), seeded order."""
    total = sum(mix.values())
    exact = {k: n * v / total for k, v in mix.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    order = [k for k in sorted(counts) for _ in range(counts[k])]
    random.Random(seed).shuffle(order)
    return order


def _clear(out_dir: Path) -> None:
    """Remove what a previous run wrote, and only that (out_dir may hold other files)."""
    for name in ("games", *SPLITS):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("expert_trajectories.parquet", "tasks.parquet", "summary.json"):
        (out_dir / name).unlink(missing_ok=True)


def _prune_games(out_dir: Path, keep: set[str]) -> None:
    """Delete compiled games of rejected candidates (unwinnable or duplicate)."""
    games = out_dir / "games"
    if games.is_dir():
        for f in games.iterdir():
            if f"games/{f.with_suffix('.z8').name}" not in keep:
                f.unlink()
        if not any(games.iterdir()):
            games.rmdir()


def synthesize(params: SynthesizeParams, out_dir: Path, progress: bool = True) -> dict:
    """Generate, verify and write every split under `out_dir`; return the summary.
    Workers are spawned (a calling script needs the `if __name__ == "__main__":` guard), or Ray tasks
    inside an enabled `fanout.session`: the same bytes either way."""
    out_dir = Path(out_dir)
    splits = [s for s in SPLITS if s in params.splits]
    for split in splits:
        n = params.splits[split].n_tasks
        if n * (MAX_RETRIES + 1) > SEED_STRIDE:
            raise ValueError(f"splits.{split}.n_tasks = {n}: at most {SEED_STRIDE // (MAX_RETRIES + 1)} (seed range)")
    _clear(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start, seen, expert_rows, task_rows = time.time(), set(), [], []
    rejected = {"generator": 0, "unwinnable": 0, "duplicate": 0}
    seconds: dict[str, list[float]] = {}
    knobs = {name: t.resolved() for name, t in params.task_types.items()}
    versions = {f: env_version(f) for f in sorted(params.families(splits))}
    summary: dict = {"env_versions": versions, "splits": {}}
    types = {split: allot(params.splits[split].mix, params.splits[split].n_tasks, params.splits[split].seed)
             for split in splits}
    rec = params.recovery
    extras = Extras(rec.episodes_per_task, tuple(rec.mistakes), rec.alternatives)

    def submit(split: str, i: int, attempt: int):
        ttype = types[split][i]
        if attempt > MAX_RETRIES:
            raise RuntimeError(
                f"synthesize: {split} task {i} ({ttype}): no winnable, unseen task in {MAX_RETRIES + 1} seeds; "
                "widen its difficulty or raise max_expert_steps"
            )
        sp = params.splits[split]
        return pool.submit(_timed_build, params.task_types[ttype].family, f"{split}-{i:04d}-{ttype}", ttype,
                           task_seed(sp.seed, sp.n_tasks, i, attempt), knobs[ttype], str(out_dir),
                           params.max_expert_steps, extras if split in TRAIN_SPLITS else Extras())

    # imported here: loading params imports this package (the generators' checks), and only that
    from agentkiln import fanout

    # Workers start with a fixed hash seed: TextWorld iterates sets while writing a game (fail events,
    # the names it excludes), so with Python's random per-process seed the same params gave different
    # .z8/.json bytes. In a Ray session they are Ray tasks (the cluster's CPUs, not `workers`, bound
    # them); else spawned processes: safe even when the caller has threads (Prefect's task runners)
    if fanout.active():
        pool = fanout.RayExecutor(env_vars={"PYTHONHASHSEED": WORKER_HASH_SEED})
    else:
        pool = ProcessPoolExecutor(max_workers=params.workers, mp_context=multiprocessing.get_context("spawn"))
    hash_seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = WORKER_HASH_SEED
    try:
        # every split's first attempts are queued at once so workers never idle between splits;
        # admission is still decided in split order, then task order, whatever finishes first
        futures = {(s, i): submit(s, i, 0) for s in splits for i in range(params.splits[s].n_tasks)}
        for split in splits:
            sp = params.splits[split]
            results: list[dict] = [{}] * sp.n_tasks
            attempt = [0] * sp.n_tasks
            todo = list(range(sp.n_tasks))
            bar = tqdm(total=sp.n_tasks, desc=f"synthesize {split}", disable=not progress)
            while todo:
                retry = []
                for i in todo:
                    res = futures[split, i].result()
                    seconds.setdefault(types[split][i], []).append(res["seconds"])
                    reason = res["reason"] or ("duplicate" if res["task"].fingerprint in seen else None)
                    if reason:
                        rejected[reason] += 1
                        attempt[i] += 1
                        futures[split, i] = submit(split, i, attempt[i])
                        retry.append(i)
                        continue
                    seen.add(res["task"].fingerprint)
                    results[i] = res
                    bar.update(1)
                todo = retry
            bar.close()
            tasks = [asdict(r["task"]) for r in results]
            manifest = {"split": split, "seed": sp.seed, "env_versions": {f: versions[f] for f in
                        sorted({t["family"] for t in tasks})}, "n_tasks": len(tasks), "tasks": tasks}
            (out_dir / split).mkdir()
            (out_dir / split / "manifest.json").write_text(json.dumps(seal(manifest), indent=2, sort_keys=True) + "\n")
            task_rows += [_task_row(split, t, versions[t["family"]]) for t in tasks]
            episodes = {}
            if split in TRAIN_SPLITS:  # the panels' solutions are never training data
                for r in results:
                    expert_rows += _episode_rows(split, r)
                    for e in [{"variant": "clean"}] + r["extra"]:
                        episodes[e["variant"]] = episodes.get(e["variant"], 0) + 1
            summary["splits"][split] = {
                "n_tasks": len(tasks),
                "by_type": {k: types[split].count(k) for k in sorted(set(types[split]))},
                "mean_expert_steps": round(sum(t["expert_steps"] for t in tasks) / len(tasks), 2),
                **({"episodes": episodes, "extra_dropped": sum(r["dropped"] for r in results)} if episodes else {}),
            }
    finally:  # on an error, stop now rather than after every queued task is built
        pool.shutdown(cancel_futures=True)
        if hash_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = hash_seed
    _prune_games(out_dir, {t["game_file"] for t in (json.loads(r["data"]) for r in task_rows) if "game_file" in t})
    df = validate_expert_trajectories(pd.DataFrame(expert_rows), source="synthesized expert trajectories")
    df.to_parquet(out_dir / "expert_trajectories.parquet", index=False)
    validate_task_table(pd.DataFrame(task_rows), source="synthesized task table").to_parquet(
        out_dir / "tasks.parquet", index=False)
    summary |= {
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected,
        "expert_steps": len(df),
        "seconds": round(time.time() - start, 1),
        # worker time per generated task (generation + verification), rejected ones included
        "seconds_per_task": {k: round(sum(v) / len(v), 3) for k, v in sorted(seconds.items())},
    }
    # timings go to the returned summary (and MLflow), not to the versioned data: same params, same bytes
    stable = {k: v for k, v in summary.items() if k not in ("seconds", "seconds_per_task")}
    (out_dir / "summary.json").write_text(json.dumps(stable, indent=2, sort_keys=True) + "\n")
    return summary


def _timed_build(*args) -> dict:
    # the family: then this worker parses TextWorld's cooking logic once and compiles without Inform's Index
    if args[0] == "textworld":
        from agentkiln.synthesis import textworld_kb, textworld_noindex  # noqa: F401
    start = time.perf_counter()
    return build(*args) | {"seconds": time.perf_counter() - start}


def _episode_rows(split: str, result: dict) -> list[dict]:
    """Rows of one admitted task's episodes: the clean walkthrough, then the extra ones in order."""
    t, out = result["task"], []
    for e in [{"variant": "clean", "index": None, "rows": result["rows"]}] + result["extra"]:
        key = f"{t.task_id}/{e['variant']}" + ("" if e["index"] is None else f"-{e['index']}")
        for k, row in enumerate(e["rows"]):
            out.append({"task_id": t.task_id, "split": split, "family": t.family, "task_type": t.task_type,
                        "episode": key, "variant": e["variant"], "step": k, **row, "mistake": row.get("mistake", False)})
    return out


def _task_row(split: str, t: dict, version: str) -> dict:
    return {"task_id": t["task_id"], "split": split, "family": t["family"], "task_type": t["task_type"],
            "seed": t["seed"], "expert_steps": t["expert_steps"], "fingerprint": t["fingerprint"],
            "difficulty": json.dumps(t["difficulty"], sort_keys=True), "data": json.dumps(t["data"], sort_keys=True),
            "env_version": version}
