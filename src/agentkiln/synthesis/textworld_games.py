"""Generate TextWorld games offline into seeded, disjoint splits with manifests.

Task i of a split gets seed `split.seed * 100_000 + i` (+ 1_000 per retry). Game types are allotted
to a split in proportion to `mix` (largest remainder), in an order shuffled by the split's seed.
A game enters only if its expert walkthrough wins within `max_expert_steps` (the verification
gate) and its content fingerprint appeared in no earlier split (sft, then rl, then test).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
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
    if d.pop("challenge") == "coin_collector":
        game = coin_collector.make({"level": d["level"]}, opts)
    else:
        game = cooking.make({**d, "split": "train", "recipe_seed": seed}, opts)
    out = Path(textworld.generator.compile_game(game, opts))
    path.with_suffix(".ni").unlink(missing_ok=True)  # Inform 7 source: not needed to play
    return out


def _play_expert(game_file: Path, max_steps: int) -> tuple[bool, str, list[dict]]:
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


def _build(task_id: str, game_type: str, spec: dict, seed: int, games_dir: str, max_steps: int) -> dict | None:
    """Worker: generate one game and verify it; None when the expert cannot win it."""
    difficulty = _difficulty(spec, seed)
    path = Path(games_dir) / f"{task_id}.z8"
    game_file = _make_game(difficulty, seed, path)
    won, fingerprint, rows = _play_expert(game_file, max_steps)
    if not won:
        for f in path.parent.glob(f"{task_id}.*"):
            f.unlink()
        return None
    task = TaskSpec(task_id, "textworld", game_type, f"games/{path.name}", seed, difficulty, len(rows))
    return {"task": asdict(task), "fingerprint": fingerprint, "rows": rows}


def synthesize(params: SynthesizeParams, out_dir: Path, progress: bool = True) -> dict:
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    games_dir = out_dir / "games"
    games_dir.mkdir(parents=True)
    start, seen, rows, rejected = time.time(), set(), [], 0
    summary: dict = {"env_version": env_version(), "splits": {}}
    with ProcessPoolExecutor(max_workers=params.workers) as pool:
        for split in SPLITS:
            sp = params.splits[split]
            types = allot(sp.mix, sp.n_games, sp.seed)
            results: list[dict | None] = [None] * sp.n_games
            attempt = [0] * sp.n_games
            todo = list(range(sp.n_games))
            bar = tqdm(total=sp.n_games, desc=f"synthesize {split}", disable=not progress)
            while todo:
                futures = {}
                for i in todo:
                    if attempt[i] > MAX_RETRIES:
                        raise RuntimeError(
                            f"synthesize: {split} task {i} ({types[i]}): no verifiable, unseen game after "
                            f"{MAX_RETRIES} seeds; loosen its difficulty or max_expert_steps in params.yaml"
                        )
                    seed = sp.seed * 100_000 + i + 1_000 * attempt[i]
                    task_id = f"{split}-{i:04d}-{types[i]}"
                    futures[i] = pool.submit(
                        _build, task_id, types[i], params.game_types[types[i]].model_dump(), seed,
                        str(games_dir), params.max_expert_steps,
                    )
                retry = []
                for i in todo:  # collect in index order: deterministic whatever finishes first
                    res = futures[i].result()
                    if res is None or res["fingerprint"] in seen:
                        rejected += 1
                        attempt[i] += 1
                        retry.append(i)
                        continue
                    seen.add(res["fingerprint"])
                    results[i] = res
                    bar.update(1)
                todo = retry
            bar.close()
            tasks = [r["task"] for r in results]
            manifest = {"split": split, "seed": sp.seed, "env_version": summary["env_version"], "n_tasks": len(tasks), "tasks": tasks}
            (out_dir / split).mkdir()
            (out_dir / split / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if split != "test":  # the panel's walkthroughs are never training data
                for r in results:
                    t = r["task"]
                    rows += [{"task_id": t["task_id"], "split": split, "game_type": t["game_type"], "step": k, **row}
                             for k, row in enumerate(r["rows"])]
            summary["splits"][split] = {
                "n_tasks": len(tasks),
                "by_type": {k: types.count(k) for k in sorted(set(types))},
                "mean_expert_steps": sum(t["expert_steps"] for t in tasks) / len(tasks),
            }
    df = validate_expert_trajectories(pd.DataFrame(rows), source="synthesized expert trajectories")
    df.to_parquet(out_dir / "expert_trajectories.parquet", index=False)
    summary |= {"rejected": rejected, "expert_steps": len(df), "seconds": round(time.time() - start, 1)}
    (out_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "seconds"}, indent=2, sort_keys=True) + "\n")
    return summary
