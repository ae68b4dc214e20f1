"""Sokoban: push every box onto a target in a small walled room.

The agent sees the room as rows of space-separated symbols (legend in the goal):
`#` wall, `_` floor, `@` you, `$` box, `.` target, `*` box on a target, `+` you on a target.
Actions: `down`, `left`, `right`, `up` (admissible: the moves not blocked by a wall or by a box that
cannot move, sorted). Walking into a box pushes it one cell if the cell behind it is free.
Reward 1.0 on the move that puts the last box on its target (won). A box pushed where it can never
reach a target again (a dead cell, or frozen in a 2x2 block of walls and boxes off target) ends the
episode, lost, reward 0.
The task's data is the level as rows of the same symbols (`rows`); the knobs (room size, number of
boxes, optimal solution length) live in the generator, agentkiln.synthesis.sokoban.
The oracle is an A* search over (player, boxes) states with an admissible, consistent heuristic (sum
of each box's push distance to its nearest target), so its plans are move-optimal; it caches the
plan and searches again from the current state when the agent left it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of

ACTIONS = ("down", "left", "right", "up")  # sorted: the admissible list keeps this order
WALL, FLOOR, PLAYER, BOX, TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET = "#", "_", "@", "$", ".", "*", "+"
LEGEND = "# wall, _ floor, @ you, $ box, . target, * box on target, + you on target"
_INDEX = {a: i for i, a in enumerate(ACTIONS)}
MAX_NODES = 200_000  # the oracle gives up (None) beyond this many expanded states


@dataclass(frozen=True)
class Room:
    """The static part of a level; cells are indices r * width + c, box sets are bitmasks."""

    width: int
    height: int
    walls: frozenset[int]
    targets: int  # bitmask of target cells
    n_boxes: int
    dead: frozenset[int]  # floor cells from which no push sequence reaches a target
    dist: tuple[int, ...]  # pushes from each cell to the nearest target, ignoring the other boxes
    squares: tuple[tuple[tuple[int, ...], ...], ...]  # per cell: the 2x2 blocks that contain it

    @property
    def offsets(self) -> tuple[int, int, int, int]:  # cell offset of each of ACTIONS
        return (self.width, -1, 1, -self.width)


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@lru_cache(maxsize=4096)
def parse(rows: tuple[str, ...]) -> tuple[Room, int, int]:
    """(room, player cell, box bitmask) of a level written in the rendering's symbols."""
    height, width = len(rows), len(rows[0])
    if height < 3 or width < 3 or any(len(r) != width for r in rows):
        raise ValueError("sokoban: a level is a non-empty rectangle of rows")
    walls, targets, boxes, player = set(), 0, 0, -1
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            i = r * width + c
            if ch == WALL or r in (0, height - 1) or c in (0, width - 1):  # the border is always wall
                walls.add(i)
            if ch in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                targets |= 1 << i
            if ch in (BOX, BOX_ON_TARGET):
                boxes |= 1 << i
            if ch in (PLAYER, PLAYER_ON_TARGET):
                player = i
    n = bin(boxes).count("1")
    if player < 0 or n == 0 or n != bin(targets).count("1"):
        raise ValueError("sokoban: a level needs a player and as many boxes as targets")
    floor = [i for i in range(width * height) if i not in walls]
    # pull distances from the targets: a box at b can be pulled to b+d when b+d and b+2d are floor
    inf = 10**6
    dist = [inf] * (width * height)
    frontier = list(_bits(targets))
    for t in frontier:
        dist[t] = 0
    steps = (width, -1, 1, -width)
    while frontier:
        nxt = []
        for b in frontier:
            for d in steps:
                if b + d not in walls and b + 2 * d not in walls and dist[b + d] == inf:
                    dist[b + d] = dist[b] + 1
                    nxt.append(b + d)
        frontier = nxt
    dead = frozenset(i for i in floor if dist[i] == inf)
    squares = []
    for i in range(width * height):
        r, c = divmod(i, width)
        sq = []
        for r0 in (r - 1, r):
            for c0 in (c - 1, c):
                if 0 <= r0 < height - 1 and 0 <= c0 < width - 1:
                    top = r0 * width + c0
                    sq.append((top, top + 1, top + width, top + width + 1))
        squares.append(tuple(sq))
    room = Room(width, height, frozenset(walls), targets, n, dead, tuple(dist), tuple(squares))
    return room, player, boxes


def render_rows(room: Room, player: int, boxes: int) -> list[str]:
    """The level as rows of symbols (no spaces): the task data format."""
    rows = []
    for r in range(room.height):
        row = []
        for i in range(r * room.width, (r + 1) * room.width):
            on_target, box = room.targets >> i & 1, boxes >> i & 1
            if i in room.walls:
                row.append(WALL)
            elif i == player:
                row.append(PLAYER_ON_TARGET if on_target else PLAYER)
            elif box:
                row.append(BOX_ON_TARGET if on_target else BOX)
            else:
                row.append(TARGET if on_target else FLOOR)
        rows.append("".join(row))
    return rows


def frozen(room: Room, boxes: int, cell: int) -> bool:
    """Whether the box at `cell` is certainly stuck: on a dead cell, or in a 2x2 block made only
    of walls and boxes with one of those boxes off target (none of them can ever move)."""
    if cell in room.dead:
        return True
    for square in room.squares[cell]:
        if all(i in room.walls or boxes >> i & 1 for i in square):
            if any(boxes >> i & 1 and not room.targets >> i & 1 for i in square):
                return True
    return False


def move(room: Room, player: int, boxes: int, action: str) -> tuple[int, int, int] | str:
    """(player, boxes, pushed box's new cell or -1) after a move, or why the move is blocked."""
    d = room.offsets[_INDEX[action]]
    q = player + d
    if q in room.walls:
        return "a wall is in the way"
    if not boxes >> q & 1:
        return q, boxes, -1
    r = q + d
    if r in room.walls or boxes >> r & 1:
        return "the box cannot move there"
    return q, boxes ^ (1 << q) ^ (1 << r), r


def solve(room: Room, player: int, boxes: int, max_nodes: int = MAX_NODES, limit: int | None = None
          ) -> list[str] | None:
    """A move-optimal plan from (player, boxes) by A*, or None when there is none (within `limit`
    moves) or the search expanded more than `max_nodes` states."""
    if boxes == room.targets:
        return []
    offsets = list(zip(ACTIONS, room.offsets))
    h0 = sum(room.dist[b] for b in _bits(boxes))
    if h0 >= 10**6:
        return None
    start = (player, boxes)
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    best = {start: 0}
    heap = [(h0, 0, 0, player, boxes, h0)]
    counter, expanded = 0, 0
    walls, dist = room.walls, room.dist
    while heap:
        f, neg_g, _, p, bx, h = heapq.heappop(heap)
        g = -neg_g
        if best.get((p, bx), -1) < g:
            continue  # a stale entry: the state was reached more cheaply since
        if bx == room.targets:
            plan, key = [], (p, bx)
            while parent[key] is not None:
                key, a = parent[key]
                plan.append(a)
            return plan[::-1]
        expanded += 1
        if expanded > max_nodes:
            return None
        for a, d in offsets:
            q = p + d
            if q in walls:
                continue
            nb, nh = bx, h
            if bx >> q & 1:
                r = q + d
                if r in walls or bx >> r & 1:
                    continue
                nb = bx ^ (1 << q) ^ (1 << r)
                if frozen(room, nb, r):
                    continue
                nh = h - dist[q] + dist[r]
            key = (q, nb)
            if g + 1 < best.get(key, 10**9) and (limit is None or g + 1 + nh <= limit):
                best[key] = g + 1
                parent[key] = ((p, bx), a)
                counter += 1
                # ties on f: deeper first (reaches the goal sooner), then insertion order
                heapq.heappush(heap, (g + 1 + nh, -(g + 1), counter, q, nb, nh))
    return None


class SokobanEnv(Env):
    family = "sokoban"

    def _reset(self) -> Observation:
        self.room, self.player, self.boxes = parse(tuple(self.task.data["rows"]))
        n = self.room.n_boxes
        self.goal = (f"Push {'the box' if n == 1 else f'all {n} boxes'} onto the "
                     f"{'target' if n == 1 else 'targets'}. Legend: {LEGEND}. Walking into a box pushes it.")
        self._plan: dict[tuple[int, int], str] = {}
        return self._observe("You are in the room.")

    def _admissible(self) -> list[str]:
        return [a for a in ACTIONS if not isinstance(move(self.room, self.player, self.boxes, a), str)]

    def _observe(self, feedback: str) -> Observation:
        grid = "\n".join(" ".join(row) for row in render_rows(self.room, self.player, self.boxes))
        placed = bin(self.boxes & self.room.targets).count("1")
        text = f"{feedback}\n{grid}\nBoxes on targets: {placed} of {self.room.n_boxes}."
        return Observation(text, self._admissible(), anchor_of(self.player, self.boxes))

    def _step(self, action: str) -> StepResult:
        if action not in ACTIONS:
            return self.invalid(action, "not a move")
        res = move(self.room, self.player, self.boxes, action)
        if isinstance(res, str):
            return self.invalid(action, f"blocked, {res}")
        self.player, self.boxes, pushed = res
        won = self.boxes == self.room.targets
        lost = not won and pushed >= 0 and frozen(self.room, self.boxes, pushed)
        if won:
            feedback = "You push the last box onto its target. You won."
        elif lost:
            feedback = f"You push the box {action}. It is stuck and can never reach a target. You lost."
        elif pushed >= 0:
            feedback = f"You push the box {action}{' onto a target' if self.room.targets >> pushed & 1 else ''}."
        else:
            feedback = f"You move {action}."
        return StepResult(self._observe(feedback), 1.0 if won else 0.0, won or lost,
                          {"won": won, "lost": lost, "invalid": False})

    def _expert(self) -> str | None:
        key = (self.player, self.boxes)
        if key not in self._plan:  # first call, or the agent left the cached plan: search again
            plan = solve(self.room, self.player, self.boxes)
            if not plan:
                return None
            self._plan, p, bx = {}, self.player, self.boxes
            for a in plan:
                self._plan[p, bx] = a
                p, bx, _ = move(self.room, p, bx, a)
        return self._plan[key]
