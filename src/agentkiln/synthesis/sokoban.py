"""Sokoban levels by reverse play, so every level is solvable by construction.

From one seed: carve a connected room by a random walk inside a width x height box of walls, put the
boxes on random targets (the solved state) and the player next to a box (where a last push ends),
then walk the player `reverse_steps` steps, mostly straight on, pulling a box along when stepping
away from it (a pull is a push played backwards). The level is the state of that walk whose boxes
are farthest, in pushes, from the targets. The oracle's A* then measures the optimal solution
length; a level is kept only if it lies in [min_steps, max_steps], else the next room of the seed's
random stream is tried (ATTEMPTS rooms per seed).

Knobs: width, height (state size; the outer ring is wall), n_boxes (state size and branching),
reverse_steps (how scrambled), min_steps / max_steps (bounds on the move-optimal solution length),
max_turns. The action space is fixed: four moves.
"""

from __future__ import annotations

import random
from pathlib import Path

from agentkiln.envs.base import TaskSpec
from agentkiln.envs.sokoban import frozen, parse, solve
from agentkiln.synthesis.generate import check_int_knobs

FAMILY = "sokoban"
VERSION = ""
LEVELS: dict[str, dict] = {
    "easy": {"width": 6, "height": 6, "n_boxes": 1, "reverse_steps": 60, "min_steps": 3, "max_steps": 12,
             "max_turns": 30},
    "medium": {"width": 7, "height": 7, "n_boxes": 2, "reverse_steps": 150, "min_steps": 8, "max_steps": 25,
               "max_turns": 50},
    "hard": {"width": 8, "height": 8, "n_boxes": 3, "reverse_steps": 300, "min_steps": 14, "max_steps": 45,
             "max_turns": 80},
}
RANGES = {"width": (5, 10), "height": (5, 10), "n_boxes": (1, 4), "reverse_steps": (1, 1000),
          "min_steps": (1, 100), "max_steps": (1, 100), "max_turns": (1, 500)}
FLOOR_SHARE = 0.75  # of the interior cells carved to floor
ATTEMPTS = 30  # rooms tried per seed before giving up (generate() then moves on to the next seed)
DIRS = ((1, 0), (0, -1), (0, 1), (-1, 0))  # (row, col) steps


def check(knobs: dict) -> None:
    check_int_knobs(FAMILY, knobs, RANGES)
    if knobs["max_steps"] < knobs["min_steps"]:
        raise ValueError(f"{FAMILY}: knob max_steps = {knobs['max_steps']}: must be >= min_steps "
                         f"= {knobs['min_steps']}")
    if knobs["max_turns"] < knobs["max_steps"]:
        raise ValueError(f"{FAMILY}: knob max_turns = {knobs['max_turns']}: must be >= max_steps "
                         f"= {knobs['max_steps']}")
    interior = (knobs["width"] - 2) * (knobs["height"] - 2)
    if 2 * knobs["n_boxes"] + 2 > int(FLOOR_SHARE * interior):
        raise ValueError(f"{FAMILY}: knob n_boxes = {knobs['n_boxes']}: too many for a "
                         f"{knobs['width']}x{knobs['height']} room")


def carve(rng: random.Random, width: int, height: int) -> set[tuple[int, int]]:
    """Floor cells of a connected room: a random walk inside the border that turns now and then."""
    want = int(FLOOR_SHARE * (width - 2) * (height - 2))
    r, c = rng.randint(1, height - 2), rng.randint(1, width - 2)
    floor = {(r, c)}
    dr, dc = rng.choice(DIRS)
    while len(floor) < want:
        if rng.random() < 0.35:
            dr, dc = rng.choice(DIRS)
        if 1 <= r + dr <= height - 2 and 1 <= c + dc <= width - 2:
            r, c = r + dr, c + dc
            floor.add((r, c))
    return floor


def scramble(rng: random.Random, knobs: dict) -> list[str] | None:
    """One level: a carved room, boxes on targets, then reverse play; of the states the walk passes,
    the one whose boxes are farthest (in pushes) from the targets. None if no box ever moved."""
    width, height = knobs["width"], knobs["height"]
    cells = sorted(carve(rng, width, height))
    targets = set(rng.sample(cells, knobs["n_boxes"]))
    boxes = set(targets)
    # the player starts where the last push of a solution ends: next to a box
    beside = [c for c in cells if c not in boxes and any((c[0] + dr, c[1] + dc) in boxes for dr, dc in DIRS)]
    player = rng.choice(beside or [c for c in cells if c not in boxes])
    rows = _rows(width, height, set(cells), targets, boxes, player)
    room, _, _ = parse(tuple(rows))  # for its push distances
    floor = set(cells)
    d = rng.choice(DIRS)
    best, best_h, h = None, 0, 0
    for _ in range(knobs["reverse_steps"]):
        if rng.random() < 0.3:  # keep going the same way most of the time: pulls add up
            d = rng.choice(DIRS)
        q = (player[0] + d[0], player[1] + d[1])
        if q not in floor or q in boxes:
            d = rng.choice(DIRS)
            continue
        behind = (player[0] - d[0], player[1] - d[1])
        if behind in boxes:  # a pull: the box follows the player
            boxes.remove(behind)
            boxes.add(player)
            h += room.dist[player[0] * width + player[1]] - room.dist[behind[0] * width + behind[1]]
        player = q
        if h >= best_h and h > 0:
            best, best_h = (set(boxes), player), h
    return None if best is None else _rows(width, height, floor, targets, *best)


def _rows(width: int, height: int, floor: set, targets: set, boxes: set, player: tuple[int, int]) -> list[str]:
    rows = []
    for r in range(height):
        row = ""
        for c in range(width):
            cell = (r, c)
            if cell not in floor:
                row += "#"
            elif cell == player:
                row += "+" if cell in targets else "@"
            elif cell in boxes:
                row += "*" if cell in targets else "$"
            else:
                row += "." if cell in targets else "_"
        rows.append(row)
    return rows


def candidate(seed: int, knobs: dict, out_dir: Path | None = None) -> TaskSpec | None:
    check(knobs)
    rng = random.Random(seed)
    for _ in range(ATTEMPTS):
        rows = scramble(rng, knobs)
        if rows is None:
            continue
        room, player, boxes = parse(tuple(rows))
        if any(frozen(room, boxes, b) for b in range(room.width * room.height) if boxes >> b & 1):
            continue  # cannot happen for pulled boxes, but a level must never start lost
        plan = solve(room, player, boxes, limit=knobs["max_steps"])
        if plan and knobs["min_steps"] <= len(plan) <= knobs["max_steps"]:
            return TaskSpec(task_id=f"{FAMILY}-{seed}", family=FAMILY, seed=seed,
                            data={"rows": rows, "optimal_steps": len(plan)})
    return None
