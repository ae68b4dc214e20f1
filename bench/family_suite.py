"""The family suite: for every family, N tasks at each of the three levels; the expert must win
every admitted task (replayed in a fresh environment), and the same seed must give the same tasks
and the same observation sequences (generated twice, a seeded random walk replayed twice).

    python bench/family_suite.py                    # 200 per level, all families -> bench/results/family_suite.json
    python bench/family_suite.py --n 20 --families sokoban sql

TextWorld (per game) and gym-toytext (FrozenLake, Taxi) are checked per game. TextWorld compiles
each game (about a second): its determinism check regenerates `--textworld-recheck` tasks per level
rather than all of them. Taxi's single map has 300 start states, so it gets at most TAXI_N tasks
per level.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from agentkiln.envs import FAMILIES, make
from agentkiln.synthesis import generate
from agentkiln.synthesis.generate import play_expert

LEVELS = ("easy", "medium", "hard")
TAXI_N = 40  # distinct Taxi starts with a 6-10 step solution (easy) number about 50


def walk(task, tasks_dir, seed: int, steps: int = 12) -> list:
    """A seeded random walk (admissible actions, else the oracle's) and every observation seen."""
    rng, env = random.Random(seed), make(task, tasks_dir)
    obs, seen = env.reset(), []
    seen.append((obs.text, obs.admissible, obs.anchor))
    for _ in range(steps):
        a = rng.choice(obs.admissible) if obs.admissible else (env.expert_action() or "noop")
        res = env.step(a)
        obs = res.observation
        seen.append((obs.text, obs.admissible, obs.anchor, res.reward, res.done))
        if res.done:
            break
    env.close()
    return seen


def check_level(family: str, level: str, n: int, seed: int, recheck: int | None, knobs: dict) -> dict:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        t0 = time.perf_counter()
        tasks = generate(family, n, seed=seed, level=level, out_dir=a, **knobs)
        gen_s = time.perf_counter() - t0
        solved = sum(play_expert(t, a, max_steps=200)[0] for t in tasks)
        if recheck is None:  # regenerate the whole set
            ref, ref_dir = tasks, a
        else:  # a smaller call with the same seed, generated twice
            ref_dir = os.path.join(a, "recheck")
            ref = generate(family, min(n, recheck), seed=seed, level=level, out_dir=ref_dir, **knobs)
        again = generate(family, len(ref), seed=seed, level=level, out_dir=b, **knobs)
        same_tasks = [asdict(t) for t in ref] == [asdict(t) for t in again]
        same_obs = all(walk(t, ref_dir, i) == walk(u, b, i) for i, (t, u) in enumerate(zip(ref, again)))
        k = len(ref)
    steps = [t.expert_steps for t in tasks]
    return {
        "n_tasks": len(tasks), "distinct": len({t.fingerprint for t in tasks}), "expert_solved": solved,
        "expert_solve_rate": solved / len(tasks), "same_seed_same_tasks": same_tasks,
        "same_seed_same_observations": same_obs, "determinism_checked_on": k,
        "expert_steps_mean": round(sum(steps) / len(steps), 2), "expert_steps_max": max(steps),
        "difficulty": tasks[0].difficulty, "generate_seconds": round(gen_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--textworld-recheck", type=int, default=10)
    ap.add_argument("--textworld-games", nargs="*", default=["coin_collector", "treasure_hunter", "cooking"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results/family_suite.json")
    args = ap.parse_args()
    jobs = {}
    games = {"textworld": args.textworld_games, "gym-toytext": ["frozenlake", "taxi"]}
    for f in args.families:  # families with several games: each game is checked as its own sub-family
        for name, knobs in ([(f"{f}/{g}", {"game": g}) for g in games[f]] if f in games else [(f, {})]):
            # Taxi has 300 start states on its one map, fewer than 200 per step band: it gets TAXI_N
            n = min(args.n, TAXI_N) if name == "gym-toytext/taxi" else args.n
            for lvl in LEVELS:
                jobs[name, lvl] = (f, lvl, n, args.seed, args.textworld_recheck if f == "textworld" else None, knobs)
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {key: pool.submit(check_level, *job) for key, job in jobs.items()}
        results: dict = {}
        for (family, level), fut in futures.items():
            r = results.setdefault(family, {})[level] = fut.result()
            ok = r["expert_solve_rate"] == 1.0 and r["same_seed_same_tasks"] and r["same_seed_same_observations"]
            print(f"{family:26s} {level:6s} n={r['n_tasks']:4d} distinct={r['distinct']:4d} "
                  f"expert={100 * r['expert_solve_rate']:.1f}% deterministic={ok} "
                  f"mean expert steps={r['expert_steps_mean']} ({r['generate_seconds']} s)", flush=True)
    all_ok = all(r["expert_solve_rate"] == 1.0 and r["same_seed_same_tasks"] and r["same_seed_same_observations"]
                 and r["n_tasks"] == (min(args.n, TAXI_N) if name == "gym-toytext/taxi" else args.n)
                 for name, fam in results.items() for r in fam.values())
    report = {"n_per_level": args.n, "seed": args.seed, "all_ok": all_ok, "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "families": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"all ok: {all_ok}; wrote {args.out}")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
