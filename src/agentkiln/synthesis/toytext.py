"""FrozenLake maps and Taxi start states from a seed (family gym-toytext).

FrozenLake: gymnasium's `generate_random_map(lake_size, 1 - lake_hole_p, seed)`, deterministic in its
seed, with seeds drawn from `random.Random(task seed)` until the map's shortest path is at least
`lake_min_steps` long (a plain path is 2 * (size - 1); more holes force detours). Taxi: the map is
fixed, so the task is the start state: one of the states TaxiEnv.reset() can start in, drawn by
`random.Random(task seed)` among those whose shortest solution lies in [taxi_min_steps,
taxi_max_steps] (6 to 18 on gymnasium's map).

Knobs: `game` (frozenlake or taxi: every level can play either; the level sets the default),
`lake_size`, `lake_hole_p`, `lake_min_steps` (FrozenLake's state size and solution length),
`taxi_min_steps`, `taxi_max_steps` (Taxi's solution length; its 500 states are fixed), `max_turns`.
Action spaces are the games' own: 4 moves (FrozenLake), 6 actions (Taxi).
"""

from __future__ import annotations

import random
from pathlib import Path

import gymnasium

from agentkiln.envs.base import TaskSpec
from agentkiln.envs.toytext import GAMES, lake_model, taxi_model, taxi_starts
from agentkiln.synthesis.generate import check_int_knobs

FAMILY = "gym-toytext"
VERSION = f"gymnasium-{gymnasium.__version__}"
LEVELS: dict[str, dict] = {
    "easy": {"game": "frozenlake", "lake_size": 4, "lake_hole_p": 0.2, "lake_min_steps": 6,
             "taxi_min_steps": 6, "taxi_max_steps": 10, "max_turns": 20},
    "medium": {"game": "frozenlake", "lake_size": 6, "lake_hole_p": 0.3, "lake_min_steps": 10,
               "taxi_min_steps": 10, "taxi_max_steps": 14, "max_turns": 40},
    "hard": {"game": "frozenlake", "lake_size": 8, "lake_hole_p": 0.35, "lake_min_steps": 16,
             "taxi_min_steps": 14, "taxi_max_steps": 18, "max_turns": 60},
}
INT_RANGES = {"lake_size": (3, 10), "lake_min_steps": (1, 40), "taxi_min_steps": (6, 18), "taxi_max_steps": (6, 18),
              "max_turns": (1, 500)}
HOLE_P = (0.0, 0.5)
MAP_ATTEMPTS = 200  # lake maps tried per task seed for lake_min_steps


def check(knobs: dict) -> None:
    if knobs.get("game") not in GAMES:
        raise ValueError(f"{FAMILY}: knob game = {knobs.get('game')!r}: must be one of {list(GAMES)}")
    check_int_knobs(FAMILY, knobs, INT_RANGES)
    p = knobs.get("lake_hole_p")
    if type(p) not in (int, float) or not HOLE_P[0] <= p <= HOLE_P[1]:
        raise ValueError(f"{FAMILY}: knob lake_hole_p = {p!r}: must be a number in [{HOLE_P[0]}, {HOLE_P[1]}]")
    if knobs["taxi_max_steps"] < knobs["taxi_min_steps"]:
        raise ValueError(f"{FAMILY}: knob taxi_max_steps = {knobs['taxi_max_steps']}: must be >= taxi_min_steps "
                         f"= {knobs['taxi_min_steps']}")
    size = knobs["lake_size"]
    longest = 2 * (size - 1) + 2 * (size // 2)  # a few detours; longer shortest paths are vanishingly rare
    if knobs["lake_min_steps"] > longest:
        raise ValueError(f"{FAMILY}: knob lake_min_steps = {knobs['lake_min_steps']}: must be <= {longest} "
                         f"on a {size}x{size} lake")
    bound = knobs["taxi_max_steps"] if knobs["game"] == "taxi" else knobs["lake_min_steps"]
    if knobs["max_turns"] < bound:
        raise ValueError(f"{FAMILY}: knob max_turns = {knobs['max_turns']}: must be >= "
                         f"{'taxi_max_steps' if knobs['game'] == 'taxi' else 'lake_min_steps'} = {bound}")


def candidate(seed: int, knobs: dict, out_dir: Path | None = None) -> TaskSpec | None:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    check(knobs)
    rng = random.Random(seed)
    if knobs["game"] == "taxi":
        model = taxi_model()
        starts = [s for s in taxi_starts() if knobs["taxi_min_steps"] <= model.dist[s] <= knobs["taxi_max_steps"]]
        start = rng.choice(starts)
        return TaskSpec(task_id=f"{FAMILY}-{seed}", family=FAMILY, seed=seed,
                        data={"game": "taxi", "start": start, "optimal_steps": model.dist[start]})
    for _ in range(MAP_ATTEMPTS):
        rows = generate_random_map(knobs["lake_size"], 1.0 - knobs["lake_hole_p"], seed=rng.getrandbits(32))
        steps = lake_model(tuple(rows)).dist[0]
        if knobs["lake_min_steps"] <= steps <= knobs["max_turns"]:
            return TaskSpec(task_id=f"{FAMILY}-{seed}", family=FAMILY, seed=seed,
                            data={"game": "frozenlake", "map": rows, "optimal_steps": steps})
    return None
