"""The environment contract every family and the rollout engine use.

    tasks = agentkiln.synthesis.generate("sokoban", n=10, seed=0, level="easy")   # list[TaskSpec]
    env = agentkiln.envs.make(tasks[0])     # tasks_dir= for families with files (TextWorld games)
    obs = env.reset()                       # Observation(text, admissible, anchor); env.goal
    res = env.step("push left")             # StepResult(observation, reward, done, info)
    env.expert_action()                     # the oracle's next action from here, or None when done
    env.expert_distance()                   # the oracle's steps to a win from here, None if it cannot win

Rules every family keeps (tests/test_env_contract.py checks them on all of them):
- `reset()` starts the same episode every time: same task + same seed -> same observations.
- `step()` never raises on an action: a non-string, garbage or inadmissible action costs a turn and
  returns an observation that says why, with `info["invalid"] = True`.
- `info` always has `won`, `invalid` and `turn`; `reward` is the family's task reward (1.0 on a win
  for the binary ones, WebShop's attribute match for `shop`).
- An episode ends on a win, a terminal state or `max_turns`; stepping a finished episode changes
  nothing and is reported invalid.
- `admissible` is the sorted list of valid actions, or None for free-form families (tool calls);
  `anchor` is a hash of the raw state, equal for equal states (GiGPO's step-level groups).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_TURNS = 50
EXPERT_LIMIT = 200  # steps the generic expert_distance plays before giving up


@dataclass
class Observation:
    text: str  # what the agent is shown
    admissible: list[str] | None  # sorted valid actions; None for free-form families
    anchor: str  # raw state key for step-level credit


@dataclass
class StepResult:
    observation: Observation
    reward: float
    done: bool
    info: dict = field(default_factory=dict)  # won, invalid, turn (+ family extras)


@dataclass(frozen=True)
class TaskSpec:
    """One task, JSON-serialisable (an entry of a split manifest). `data` is all the environment
    needs to rebuild the task (a level's grid, a store's seed, a game file relative to the tasks
    directory); `fingerprint` hashes the task's content for deduplication across splits."""

    task_id: str
    family: str
    seed: int
    task_type: str = ""  # the task type's name in params.yaml (or the level for generate())
    difficulty: dict = field(default_factory=dict)  # the resolved difficulty knobs
    data: dict = field(default_factory=dict)
    expert_steps: int = 0
    fingerprint: str = ""


def anchor_of(*parts: object) -> str:
    """A short stable hash of a raw state (not of its rendering)."""
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def shown(action: object, limit: int = 40) -> str:
    """A garbage action as it may be echoed back: printable, one line, short."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(action)).split())
    return text if len(text) <= limit else text[:limit] + "..."


def tool_call(action: str, tools: tuple[str, ...]) -> tuple[str, str] | None:
    """Parse `name[argument]` for one of `tools` (any case, spaces around the brackets allowed: a
    word-level tokenizer's detokenised output): (name in lower case, argument stripped) or None."""
    m = re.fullmatch(rf"\s*({'|'.join(tools)})\s*\[(.*)\]\s*", action, re.S | re.I)
    return (m.group(1).lower(), m.group(2).strip()) if m else None


def invalid_text(action: object, why: str, valid: list[str] | None = None, show: int = 8) -> str:
    """The observation for an invalid action: what was wrong and (some of) what is valid."""
    text = f'Invalid action "{shown(action)}": {why}.'
    if valid:
        more = f" (+{len(valid) - show} more)" if len(valid) > show else ""
        text += f" Valid actions: {', '.join(valid[:show])}{more}."
    return text


class Env:
    """Base of every family's environment: counts turns, ends the episode at `max_turns`, answers
    steps after the end, and turns non-string actions into invalid steps. A family implements
    `_reset() -> Observation` (setting `self.goal`), `_step(action: str) -> StepResult` (returning
    reward and `done` for its own terminal states, and info with at least `won` and `invalid`) and
    `_expert() -> str | None`."""

    family = ""
    free_form = False  # True: admissible is None and actions are free text (tool calls)
    max_reply_tokens = 16  # the family's default reply budget (tokens a free-form reply may take)
    tools: tuple[tuple[str, str, str], ...] = ()  # (name, argument, description): `name[argument]` actions

    @classmethod
    def tool_specs(cls) -> list[dict]:
        """The family's tools as function schemas (what a chat template's `tools=` renders)."""
        return [{"type": "function", "function": {"name": name, "description": what, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
            for name, arg, what in cls.tools]

    def __init__(self, task: TaskSpec, max_turns: int | None = None, tasks_dir: str | Path | None = None):
        self.task = task
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else None  # for task files
        self.max_turns = max_turns or task.difficulty.get("max_turns", DEFAULT_MAX_TURNS)
        self.goal = ""
        self.turn, self.done, self.won = 0, True, False
        self.truncated = False  # the episode ended only because max_turns ran out (gymnasium's truncated)
        self._obs: Observation | None = None
        self._started = False
        self.actions: list = []  # every action stepped since reset (the generic expert_distance replays them)

    # -- the contract -------------------------------------------------------------------------
    def reset(self) -> Observation:
        self.turn, self.done, self.won, self.truncated = 0, False, False, False
        self._started = True
        self.actions = []
        self._obs = self._reset()
        return self._obs

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self.done:  # stepping a finished episode changes nothing
            return StepResult(self._obs, 0.0, True, {"won": self.won, "invalid": True, "turn": self.turn})
        self.turn += 1
        self.actions.append(action)
        if not isinstance(action, str):
            res = self.invalid(action, f"an action is a string, got {type(action).__name__}")
        else:
            res = self._step(action)
        self.won = self.won or bool(res.info.get("won", False))
        ended_by_task = res.done or self.won
        self.done = ended_by_task or self.turn >= self.max_turns
        self.truncated = self.done and not ended_by_task
        res.done = self.done
        res.info = {"won": self.won, "invalid": False, **res.info, "turn": self.turn}
        self._obs = res.observation
        return res

    def expert_action(self) -> str | None:
        if self.done or not self._started:
            return None
        return self._expert()

    def expert_distance(self, limit: int = EXPERT_LIMIT) -> int | None:
        """The expert's steps from the current state to a win (0 once won), or None when it cannot win
        from here (a lost game, or not within `limit` steps): potential-based shaping's distance.
        Generic: a fresh environment of the same task replays the actions taken so far, then the expert
        plays it out (a family overrides this where its state gives the distance directly). Turn limits
        do not count: the replica has room for the replay and `limit` more steps."""
        if not self._started:
            return None
        if self.won:
            return 0
        twin = type(self)(self.task, max_turns=len(self.actions) + limit + 1, tasks_dir=self.tasks_dir)
        try:
            twin.reset()
            for action in self.actions:
                twin.step(action)
            for n in range(limit + 1):
                if twin.won:
                    return n
                action = twin.expert_action()
                if twin.done or action is None:
                    return None
                twin.step(action)
            return None
        finally:
            twin.close()

    def close(self) -> None:
        pass

    # -- helpers for families -----------------------------------------------------------------
    def invalid(self, action: object, why: str, valid: list[str] | None = None) -> StepResult:
        """An invalid step: the state is unchanged and the observation says why."""
        obs = self._obs
        shown_valid = valid if valid is not None else obs.admissible
        text = invalid_text(action, why, shown_valid)
        return StepResult(Observation(text, obs.admissible, obs.anchor), 0.0, False, {"won": False, "invalid": True})

    # -- what a family implements -------------------------------------------------------------
    def _reset(self) -> Observation:
        raise NotImplementedError

    def _step(self, action: str) -> StepResult:
        raise NotImplementedError

    def _expert(self) -> str | None:
        raise NotImplementedError
