"""Gymnasium's toy-text games FrozenLake and Taxi, rendered as short text.

FrozenLake (`game: frozenlake`): walk from the start (top left) to the goal (bottom right) of an
n x n lake without stepping into a hole. The lake is shown as rows of space-separated tiles:
`S` start, `F` ice, `H` hole, `G` goal, `@` you, then the four neighbouring tiles in words
("Around you: down ice, left edge, right hole, up edge."). Actions: `down`, `left`, `right`, `up`. Walking
off the edge leaves you in place. Reward 1.0 on reaching the goal (won); a hole ends the episode,
lost. The ice is not slippery, so the dynamics are deterministic and the oracle exact.

Taxi (`game: taxi`, gymnasium's fixed 5x5 map with four stops R, G, Y, B): drive to the
passenger, pick them up, drive to their destination and drop them off. Actions: `dropoff`, `east`,
`north`, `pickup`, `south`, `west`; a move into a wall or the edge leaves the taxi in place, a
pickup or dropoff that does nothing is reported as such (a turn spent, not an invalid action). Reward
1.0 on the dropoff at the destination (won).

Every action of the game is admissible (sorted); anything else is invalid. The dynamics are
gymnasium's own: the transition table `P` of `FrozenLakeEnv(desc=map, is_slippery=False)` or
`TaxiEnv()`, read once per map (cached) and stepped directly, which is exact and much faster than
the env's `step()` with its wrappers and action masks. The oracle follows shortest paths to
success, computed by a backward BFS over the same table (cached with it); ties go to the first
action in sorted order. Task data: `game` plus `map` (FrozenLake's rows) or `start` (Taxi's
initial state, picked by the generator, agentkiln.synthesis.toytext, which holds the knobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of

GAMES = ("frozenlake", "taxi")
# gymnasium's action ids, in order
LAKE_ACTIONS = ("left", "down", "right", "up")
TAXI_ACTIONS = ("south", "north", "east", "west", "pickup", "dropoff")
TAXI_MOVES = 4  # the first four taxi actions move the taxi
TAXI_STOPS = "RGYB"  # the stops' letters, in the order of TaxiEnv.locs
UNREACHABLE = 10**6


@dataclass(frozen=True)
class Model:
    """A deterministic game: next state, reward and termination of each (state, action id)."""

    actions: tuple[str, ...]  # gymnasium's order: an action's index is its id
    start: int  # the start state (FrozenLake's S; Taxi's start is the task's)
    next: tuple[tuple[tuple[int, float, bool], ...], ...]
    dist: tuple[int, ...]  # actions from each state to success, UNREACHABLE if none

    @property
    def admissible(self) -> list[str]:
        return sorted(self.actions)

    def expert(self, s: int) -> str | None:
        """The first action, in sorted order, on a shortest path to success from `s`."""
        if self.dist[s] >= UNREACHABLE:
            return None
        for a in self.admissible:
            ns, r, term = self.next[s][self.actions.index(a)]
            if (term and r > 0) or (not term and self.dist[ns] == self.dist[s] - 1):
                return a
        return None


def _model(actions: tuple[str, ...], P: dict, start: int) -> Model:
    """Gymnasium's transition table `P[s][a] = [(prob, next, reward, terminated)]` (one entry each:
    the dynamics are deterministic) with each state's distance to success."""
    n = len(P)
    nxt = tuple(tuple((int(P[s][a][0][1]), float(P[s][a][0][2]), bool(P[s][a][0][3])) for a in range(len(actions)))
                for s in range(n))
    # backward BFS from the states with a winning action; terminal (hole) transitions lead nowhere
    preds: list[list[int]] = [[] for _ in range(n)]
    dist = [UNREACHABLE] * n
    frontier = []
    for s in range(n):
        for ns, r, term in nxt[s]:
            if term and r > 0 and dist[s] == UNREACHABLE:
                dist[s] = 1
                frontier.append(s)
            elif not term and ns != s:
                preds[ns].append(s)
    while frontier:
        new = []
        for x in frontier:
            for s in preds[x]:
                if dist[s] == UNREACHABLE:
                    dist[s] = dist[x] + 1
                    new.append(s)
        frontier = new
    return Model(actions, start, nxt, tuple(dist))


@lru_cache(maxsize=1024)
def lake_model(rows: tuple[str, ...]) -> Model:
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

    env = FrozenLakeEnv(desc=list(rows), is_slippery=False)
    return _model(LAKE_ACTIONS, env.P, int(env.initial_state_distrib.argmax()))


@lru_cache(maxsize=1)
def taxi_model() -> Model:
    from gymnasium.envs.toy_text.taxi import TaxiEnv

    return _model(TAXI_ACTIONS, TaxiEnv().P, 0)


@lru_cache(maxsize=1)
def taxi_starts() -> tuple[int, ...]:
    """The states TaxiEnv.reset() can start in (passenger at a stop that is not the destination)."""
    from gymnasium.envs.toy_text.taxi import TaxiEnv

    return tuple(int(s) for s in TaxiEnv().initial_state_distrib.nonzero()[0])


def taxi_decode(s: int) -> tuple[int, int, int, int]:
    """(taxi row, taxi col, passenger: stop index or 4 in the taxi, destination stop index), as
    TaxiEnv.decode."""
    s, dest = divmod(s, 4)
    s, passenger = divmod(s, 5)
    row, col = divmod(s, 5)
    return row, col, passenger, dest


TAXI_LOCS = ((0, 0), (0, 4), (4, 0), (4, 3))  # TaxiEnv.locs


def _stop(i: int) -> str:
    return f"{TAXI_STOPS[i]} (row {TAXI_LOCS[i][0]} col {TAXI_LOCS[i][1]})"


_DIRS = (("down", (1, 0)), ("left", (0, -1)), ("right", (0, 1)), ("up", (-1, 0)))
_TILES = {"S": "start", "F": "ice", "H": "hole", "G": "goal"}


class ToyTextEnv(Env):
    family = "gym-toytext"

    def _reset(self) -> Observation:
        data = self.task.data
        self.game = data["game"]
        if self.game == "frozenlake":
            self.rows = tuple(data["map"])
            self.model = lake_model(self.rows)
            self.s = self.model.start
            self.goal = ("Walk across the frozen lake from S to the goal G without falling into a hole. "
                         "Tiles: S start, F ice, H hole, G goal, @ you. Row 0 is the top.")
            return self._observe("You stand on the ice at the start.")
        self.model = taxi_model()
        self.s = int(data["start"])
        stops = ", ".join(f"{n} at row {r} col {c}" for n, (r, c) in zip(TAXI_STOPS, TAXI_LOCS))
        self.goal = ("Drive the taxi to the passenger, pick them up, drive to their destination and drop "
                     f"them off. The city has 5 rows and 5 cols, row 0 is north. Stops: {stops}.")
        return self._observe("Your taxi is ready.")

    def _observe(self, feedback: str) -> Observation:
        if self.game == "frozenlake":
            n = len(self.rows)
            r, c = divmod(self.s, n)
            grid = "\n".join(" ".join("@" if (i, j) == (r, c) else ch for j, ch in enumerate(row))
                             for i, row in enumerate(self.rows))
            # the four neighbouring tiles in words: what a small model needs to avoid holes locally
            around = ", ".join(f"{name} {self._tile(r + dr, c + dc)}" for name, (dr, dc) in _DIRS)
            text = f"{feedback}\n{grid}\nYou are at row {r} col {c}. Around you: {around}."
        else:
            row, col, passenger, dest = taxi_decode(self.s)
            if passenger == 4:
                where = "in the taxi"
            elif passenger == dest:  # only after the winning dropoff
                where = "delivered"
            else:
                where = f"waiting at {_stop(passenger)}"
            # moves that leave the taxi in place: walls and the city's edge
            moves = enumerate(TAXI_ACTIONS[:TAXI_MOVES])
            blocked = sorted(a for i, a in moves if self.model.next[self.s][i][0] == self.s)
            text = (f"{feedback} Taxi at row {row} col {col}. Passenger {where}. Destination {_stop(dest)}. "
                    f"Blocked: {', '.join(blocked) or 'none'}.")
        return Observation(text, self.model.admissible, anchor_of(self.game, self.s))

    def _tile(self, r: int, c: int) -> str:
        n = len(self.rows)
        return _TILES[self.rows[r][c]] if 0 <= r < n and 0 <= c < n else "edge"

    def _step(self, action: str) -> StepResult:
        if action not in self.model.actions:
            return self.invalid(action, f"not a {self.game} action")
        prev = self.s
        self.s, r, term = self.model.next[prev][self.model.actions.index(action)]
        won = term and r > 0
        lost = term and not won
        feedback = self._lake_feedback(action, prev, won, lost) if self.game == "frozenlake" else \
            self._taxi_feedback(action, prev, won)
        return StepResult(self._observe(feedback), 1.0 if won else 0.0, term,
                          {"won": won, "lost": lost, "invalid": False})

    def _lake_feedback(self, action: str, prev: int, won: bool, lost: bool) -> str:
        if won:
            return f"You walk {action} and reach the goal. You won."
        if lost:
            return f"You walk {action} and fall into a hole. You lost."
        return f"You walk {action}." if self.s != prev else f"You cannot walk {action}: the edge of the lake."

    def _taxi_feedback(self, action: str, prev: int, won: bool) -> str:
        before, after = taxi_decode(prev)[2], taxi_decode(self.s)[2]
        if action == "pickup":
            return "The passenger gets in." if after == 4 and before != 4 else "There is no passenger here to pick up."
        if action == "dropoff":
            if won:
                return "The passenger gets out at the destination. You won."
            if after != before:
                return f"The passenger gets out at {TAXI_STOPS[after]}, not the destination."
            return "No passenger can get out here."
        return f"You drive {action}." if self.s != prev else f"You cannot drive {action}: a wall."

    def _expert(self) -> str | None:
        return self.model.expert(self.s)

    def expert_distance(self, limit: int = 0) -> int | None:
        """Exact and O(1): the model's BFS distance to success (None from a hole or a finished game)."""
        if not self._started:
            return None
        if self.won:
            return 0
        d = self.model.dist[self.s]
        return None if d >= UNREACHABLE or (self.done and not self.truncated) else d
