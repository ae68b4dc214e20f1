"""TextWorld games behind the agentkiln environment contract.

reset() -> Observation(text, admissible, anchor); step(action) -> StepResult(observation, reward,
done, info{won, lost, invalid, turn}); expert_action() -> the oracle's next action. Invalid or
garbage actions never raise and never reach the game engine: they cost a turn and the observation
says why.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import textworld

_INFOS = textworld.EnvInfos(
    admissible_commands=True, policy_commands=True, objective=True, description=True, inventory=True,
    won=True, lost=True, feedback=True,
)
_NOISE = [
    re.compile(r"-=\s*[^=]*?\s*=-\s*\d+/\d+"),  # status line "-= Kitchen =-0/1"
    re.compile(r"Your score has just gone up by one point\.?"),
    re.compile(r"\*\*\*\s*The End\s*\*\*\*"),
    re.compile(r"You scored \d+ out of a possible \d+.*", re.S),
    re.compile(r"Would you like to (RESTART|QUIT).*", re.S),
]
_META = {"look", "inventory"}


def clean(text: str) -> str:
    """Strip TextWorld's banner, prompts, score messages and runs of whitespace."""
    for pat in _NOISE:
        text = pat.sub(" ", text)
    text = text.replace(">", " ")
    return re.sub(r"\s+", " ", text).strip()


def _keep(cmd: str) -> bool:
    # look/inventory/examine waste turns and bloat prompts; the cookbook is the exception
    return cmd not in _META and (not cmd.startswith("examine ") or cmd == "examine cookbook")


@dataclass
class Observation:
    text: str
    admissible: list[str] | None
    anchor: str


@dataclass
class StepResult:
    observation: Observation
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class TextWorldEnv:
    def __init__(self, game_file: str | Path, max_turns: int):
        self.game_file, self.max_turns = str(game_file), max_turns
        self._env = None
        self.goal = ""

    def _observe(self, text: str) -> Observation:
        gs = self._state
        admissible = sorted(c for c in gs.admissible_commands if _keep(c))
        anchor = hashlib.sha1(f"{gs.description}|{gs.inventory}".encode()).hexdigest()[:16]
        return Observation(text=text, admissible=admissible, anchor=anchor)

    def reset(self) -> Observation:
        if self._env is None:
            self._env = textworld.start(self.game_file, request_infos=_INFOS)
        self._state = self._env.reset()
        self.turn, self.done, self.won = 0, False, False
        self._read_cookbook = False
        self.goal = clean(self._state.objective)
        self._obs = self._observe(clean(self._state.description))
        return self._obs

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult(self._obs, 0.0, True, {"won": self.won, "lost": not self.won, "invalid": True, "turn": self.turn})
        self.turn += 1
        action = action if isinstance(action, str) else str(action)
        if action not in (self._obs.admissible or []):
            shown = action if len(action) <= 40 else action[:40] + "..."
            valid = ", ".join(self._obs.admissible or [])
            obs = Observation(f'Invalid action "{shown}". Valid actions: {valid}.', self._obs.admissible, self._obs.anchor)
            self.done = self.turn >= self.max_turns
            return StepResult(obs, 0.0, self.done, {"won": False, "lost": False, "invalid": True, "turn": self.turn})
        self._read_cookbook |= action == "examine cookbook"
        self._state, _, game_over = self._env.step(action)
        self.won, lost = bool(self._state.won), bool(self._state.lost)
        self.done = game_over or self.won or lost or self.turn >= self.max_turns
        self._obs = self._observe(clean(self._state.feedback))
        reward = 1.0 if self.won else 0.0
        return StepResult(self._obs, reward, self.done, {"won": self.won, "lost": lost, "invalid": False, "turn": self.turn})

    def expert_action(self) -> str | None:
        """The oracle's next action: read the cookbook first (the shortest walkthrough skips it, so
        a policy could not know the recipe), then TextWorld's walkthrough from the current state."""
        if self.done:
            return None
        if not self._read_cookbook and "examine cookbook" in (self._obs.admissible or []):
            return "examine cookbook"
        plan = self._state.policy_commands or []
        return plan[0] if plan else None

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
