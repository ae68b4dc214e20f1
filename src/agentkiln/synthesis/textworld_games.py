"""Generate TextWorld games offline into seeded, disjoint splits with manifests.

Task i of a split of n games gets seed `split.seed * 100_000 + i`, and `+ k * n` on its k-th retry
(so seeds never repeat within or across splits). Game types are allotted to a split in proportion
to `mix` (largest remainder), in an order shuffled by `random.Random(split.seed)`; a coin
collector's level is drawn uniformly from [level_min, level_max] by `random.Random(task seed)`.
A game enters only if its expert walkthrough wins within `max_expert_steps` (the verification
gate) and its content fingerprint (objective + first observation + walkthrough) was not admitted
before: not in an earlier split (sft, then rl, then test) nor earlier in the same split.
Everything is decided in task order, whatever order the workers finish in.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import shutil
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import textworld
from textworld.challenges import coin_collector, cooking
from tqdm import tqdm

from agentkiln.config import SynthesizeParams
from agentkiln.envs import TaskSpec
from agentkiln.envs.textworld_env import TextWorldEnv
from agentkiln.schemas import validate_expert_trajectories

SPLITS = ("sft", "rl", "test")
MAX_RETRIES = 20
SEED_STRIDE = 100_000  # seeds of split s live in [s * SEED_STRIDE, (s + 1) * SEED_STRIDE)


def env_version() -> str:
    """TextWorld's version + a hash of our environment and generator code: a frozen panel is only
    valid for the environment version recorded in its manifest."""
    h = hashlib.sha1()
    for f in (Path(__file__), Path(__file__).parents[1] / "envs" / "textworld_env.py"):
        h.update(f.read_bytes())
    return f"textworld-{textworld.__version__}+agentkiln-{h.hexdigest()[:12]}"


def allot(mix: dict[str, float], n: int, seed: int) -> list[str]:
    """Game type of each task: counts proportional to `mix` (largest remainder), seeded order."""
    total = sum(mix.values())
    exact = {k: n * v / total for k, v in mix.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    order = [k for k in sorted(counts) for _ in range(counts[k])]
    random.Random(seed).shuffle(order)
    return order


def _difficulty(game_type: dict, seed: int) -> dict:
    """The game type's settings with a coin collector's level range resolved by the task's seed."""
    d = dict(game_type)
    if d["challenge"] == "coin_collector":
        lo, hi = d.pop("level_min"), d.pop("level_max")
        d["level"] = random.Random(seed).randint(lo, hi)
    return d


def _make_game(difficulty: dict, seed: int, path: Path) -> Path:
    opts = textworld.GameOptions()
    opts.seeds = seed
    opts.path = str(path)
    opts.force_recompile = True
    d = dict(difficulty)
    with warnings.catch_warnings():  # jericho's "not fully supported" warning while recording the walkthrough
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        if d.pop("challenge") == "coin_collector":
            game = coin_collector.make({"level": d["level"]}, opts)
        else:
            game = cooking.make({**d, "split": "train", "recipe_seed": seed}, opts)
        out = Path(textworld.generator.compile_game(game, opts))
    path.with_suffix(".ni").unlink(missing_ok=True)  # Inform 7 source: not needed to play
    return out


def _play_expert(game_file: Path, max_steps: int) -> tuple[bool, str, list[dict]]:
    """Play the expert through the same env the agents use: (won, fingerprint, one row per step)."""
    env = TextWorldEnv(game_file, max_turns=max_steps)
    obs = env.reset()
    rows, fingerprint = [], [env.goal, obs.text]
    try:
        while (action := env.expert_action()) is not None:
            res = env.step(action)
            rows.append(
                {"goal": env.goal, "observation": obs.text, "action": action,
                 "admissible": json.dumps(obs.admissible), "reward": res.reward, "done": res.done}
            )
            fingerprint.append(action)
            obs = res.observation
            if res.done:
                break
        return env.won, hashlib.sha1("\n".join(fingerprint).encode()).hexdigest(), rows
    finally:
        env.close()


def _build(task_id: str, game_type: str, spec: dict, seed: int, games_dir: str, max_steps: int) -> dict:
    """Worker: generate one game and verify it; `task` is None when the expert cannot win it."""
    start = time.perf_counter()
    difficulty = _difficulty(spec, seed)
    path = Path(games_dir) / f"{task_id}.z8"
    game_file = _make_game(difficulty, seed, path)
    won, fingerprint, rows = _play_expert(game_file, max_steps)
    if not won:
        for f in path.parent.glob(f"{task_id}.*"):
            f.unlink()
        return {"task": None, "seconds": time.perf_counter() - start}
    task = TaskSpec(task_id, "textworld", game_type, f"games/{path.name}", seed, difficulty, len(rows))
    return {"task": asdict(task), "fingerprint": fingerprint, "rows": rows, "seconds": time.perf_counter() - start}


def _clear(out_dir: Path) -> None:
    """Remove what a previous run wrote, and only that (out_dir may hold other files)."""
    for name in ("games", *SPLITS):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("expert_trajectories.parquet", "summary.json"):
        (out_dir / name).unlink(missing_ok=True)


def synthesize(params: SynthesizeParams, out_dir: Path, progress: bool = True) -> dict:
    """Generate, verify and write the sft / rl / test splits under `out_dir`; return the summary.
    Workers are spawned: a calling script needs the `if __name__ == "__main__":` guard."""
    out_dir = Path(out_dir)
    for split in SPLITS:
        n = params.splits[split].n_games
        if n * (MAX_RETRIES + 1) > SEED_STRIDE:
            raise ValueError(f"splits.{split}.n_games = {n}: at most {SEED_STRIDE // (MAX_RETRIES + 1)} (seed range)")
    _clear(out_dir)
    games_dir = out_dir / "games"
    games_dir.mkdir(parents=True)
    start, seen, rows = time.time(), set(), []
    rejected = {"unwinnable": 0, "duplicate": 0}
    seconds: dict[str, list[float]] = {}
    summary: dict = {"env_version": env_version(), "splits": {}}
    types = {split: allot(sp.mix, sp.n_games, sp.seed) for split, sp in params.splits.items()}

    def submit(split: str, i: int, attempt: int):
        if attempt > MAX_RETRIES:
            raise RuntimeError(
                f"synthesize: {split} task {i} ({types[split][i]}): no winnable, unseen game in "
                f"{MAX_RETRIES + 1} seeds; widen its difficulty range or raise max_expert_steps"
            )
        sp, game_type = params.splits[split], types[split][i]
        seed = sp.seed * SEED_STRIDE + attempt * sp.n_games + i
        return pool.submit(_build, f"{split}-{i:04d}-{game_type}", game_type, params.game_types[game_type].model_dump(),
                           seed, str(games_dir), params.max_expert_steps)

    # spawn: safe even when the caller has threads (Prefect runs tasks in a thread pool)
    pool = ProcessPoolExecutor(max_workers=params.workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        # every split's first attempts are queued at once so workers never idle between splits;
        # admission is still decided in split order, then task order, whatever finishes first
        futures = {(split, i): submit(split, i, 0) for split in SPLITS for i in range(params.splits[split].n_games)}
        for split in SPLITS:
            sp = params.splits[split]
            results: list[dict] = [{}] * sp.n_games
            attempt = [0] * sp.n_games
            todo = list(range(sp.n_games))
            bar = tqdm(total=sp.n_games, desc=f"synthesize {split}", disable=not progress)
            while todo:
                retry = []
                for i in todo:
                    res = futures[split, i].result()
                    seconds.setdefault(types[split][i], []).append(res["seconds"])
                    if res["task"] is None:
                        reason = "unwinnable"
                    else:
                        reason = "duplicate" if res["fingerprint"] in seen else None
                    if reason:
                        rejected[reason] += 1
                        attempt[i] += 1
                        futures[split, i] = submit(split, i, attempt[i])
                        retry.append(i)
                        continue
                    seen.add(res["fingerprint"])
                    results[i] = res
                    bar.update(1)
                todo = retry
            bar.close()
            tasks = [r["task"] for r in results]
            manifest = {"split": split, "seed": sp.seed, "env_version": summary["env_version"],
                        "n_tasks": len(tasks), "tasks": tasks}
            (out_dir / split).mkdir()
            (out_dir / split / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if split != "test":  # the panel's walkthroughs are never training data
                for r in results:
                    t = r["task"]
                    rows += [{"task_id": t["task_id"], "split": split, "game_type": t["game_type"], "step": k, **row}
                             for k, row in enumerate(r["rows"])]
            summary["splits"][split] = {
                "n_tasks": len(tasks),
                "by_type": {k: types[split].count(k) for k in sorted(set(types[split]))},
                "mean_expert_steps": round(sum(t["expert_steps"] for t in tasks) / len(tasks), 2),
            }
    finally:  # on an error, stop now rather than after every queued game is built
        pool.shutdown(cancel_futures=True)
    df = validate_expert_trajectories(pd.DataFrame(rows), source="synthesized expert trajectories")
    df.to_parquet(out_dir / "expert_trajectories.parquet", index=False)
    summary |= {
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected,
        "expert_steps": len(df),
        "seconds": round(time.time() - start, 1),
        # worker time per generated game (compile + verification), rejected ones included
        "seconds_per_game": {k: round(sum(v) / len(v), 2) for k, v in sorted(seconds.items())},
    }
    # timings go to the returned summary (and MLflow), not to the versioned data: same params, same bytes
    stable = {k: v for k, v in summary.items() if k not in ("seconds", "seconds_per_game")}
    (out_dir / "summary.json").write_text(json.dumps(stable, indent=2, sort_keys=True) + "\n")
    return summary
