"""TextWorld games behind the agentkiln environment contract.

reset() -> Observation(text, admissible, anchor); step(action) -> StepResult(observation, reward,
done, info{won, lost, invalid, turn}); expert_action() -> the oracle's next action. Invalid or
garbage actions never raise and never reach the game engine: they cost a turn and the observation
says why.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import textworld

_INFOS = textworld.EnvInfos(
    admissible_commands=True, policy_commands=True, objective=True, description=True, inventory=True,
    won=True, lost=True, feedback=True,
)
_NOISE = [
    re.compile(r"^[ _|\\/$<>]*[_|\\/$][ _|\\/$<>]*$", re.M),  # the ASCII-art "TextWorld" banner
    re.compile(r"-=[^=\n]*=-\s*\d+/\d+"),  # status line "-= Kitchen =-0/1"
    re.compile(r"Your score has just gone up by \w+ points?\.?"),
    re.compile(r"\*\*\*\s*The End\s*\*\*\*"),
    re.compile(r"\*\*\*"),  # "*** You lost! ***" keeps its words
    re.compile(r"You scored \d+ out of a possible \d+.*", re.S),
    re.compile(r"Would you like to (RESTART|QUIT).*", re.S),
    re.compile(r"-{3,}"),  # the cookbook's underline
]
_ROOM = re.compile(r"-=\s*([^=\n]*?)\s*=-")  # room header "-= Kitchen =-" -> "Kitchen."
_META = {"look", "inventory"}
_SHOW_VALID = 8  # an invalid-action message lists at most this many: the prompt has the full list


def clean(text: str) -> str:
    """Strip TextWorld's banner, prompts, score messages and runs of whitespace: small models read this."""
    for pat in _NOISE:
        text = pat.sub(" ", text)
    text = _ROOM.sub(r"\1.", text).replace(">", " ")
    return re.sub(r"\s+", " ", text).strip()


def _keep(cmd: str) -> bool:
    # look/inventory/examine waste turns and bloat prompts; the cookbook is the exception
    return cmd not in _META and (not cmd.startswith("examine ") or cmd == "examine cookbook")


@dataclass
class Observation:
    text: str  # cleaned text shown to the agent
    admissible: list[str] | None  # sorted; meta commands dropped
    anchor: str  # raw state key (room description + inventory) for step-level credit


@dataclass
class StepResult:
    observation: Observation
    reward: float  # 1.0 on the step that wins, else 0.0
    done: bool
    info: dict = field(default_factory=dict)  # won, lost, invalid, turn


def _shown(action: str, limit: int = 40) -> str:
    """A garbage action as it may be echoed back: printable, one line, short."""
    text = " ".join("".join(c if c.isprintable() else " " for c in action).split())
    return text if len(text) <= limit else text[:limit] + "..."


class TextWorldEnv:
    def __init__(self, game_file: str | Path, max_turns: int):
        self.game_file, self.max_turns = str(game_file), max_turns
        self._env = None
        self.goal = ""
        self.turn, self.done, self.won, self.lost = 0, True, False, False

    def _observe(self, text: str) -> Observation:
        # admissible_commands is the costly part of a TextWorld step: read it once per step here
        gs = self._state
        admissible = sorted(c for c in gs.admissible_commands or [] if _keep(c))
        anchor = hashlib.sha1(f"{gs.description}|{gs.inventory}".encode()).hexdigest()[:16]
        return Observation(text=text, admissible=admissible, anchor=anchor)

    def _info(self, invalid: bool) -> dict:
        return {"won": self.won, "lost": self.lost, "invalid": invalid, "turn": self.turn}

    def reset(self) -> Observation:
        with warnings.catch_warnings():
            # jericho warns on every load that it has no special support for TextWorld's games;
            # score and change detection are not used here
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            if self._env is None:
                self._env = textworld.start(self.game_file, request_infos=_INFOS)
            self._state = self._env.reset()
        self.turn, self.done, self.won, self.lost = 0, False, False, False
        self._read_cookbook = False
        self.goal = clean(self._state.objective)
        # the room description, not the intro feedback: that repeats the objective (in env.goal)
        self._obs = self._observe(clean(self._state.description))
        return self._obs

    def step(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("call reset() before step()")
        if self.done:  # stepping a finished episode changes nothing
            return StepResult(self._obs, 0.0, True, self._info(invalid=True))
        self.turn += 1
        if not isinstance(action, str) or action not in self._obs.admissible:
            # never reaches the engine: garbage cannot crash or confuse the interpreter
            valid = self._obs.admissible
            more = f" (+{len(valid) - _SHOW_VALID} more)" if len(valid) > _SHOW_VALID else ""
            text = f'Invalid action "{_shown(str(action))}". Valid actions: {", ".join(valid[:_SHOW_VALID])}{more}.'
            self.done = self.turn >= self.max_turns
            obs = Observation(text, self._obs.admissible, self._obs.anchor)
            return StepResult(obs, 0.0, self.done, self._info(invalid=True))
        self._read_cookbook |= action == "examine cookbook"
        self._state, _, game_over = self._env.step(action)
        self.won, self.lost = bool(self._state.won), bool(self._state.lost)
        self.done = game_over or self.won or self.lost or self.turn >= self.max_turns
        self._obs = self._observe(clean(self._state.feedback))
        return StepResult(self._obs, 1.0 if self.won else 0.0, self.done, self._info(invalid=False))

    def expert_action(self) -> str | None:
        """The oracle's next action: read the cookbook first (the shortest walkthrough skips it, so
        a policy imitating it could not know which ingredient to take), then TextWorld's
        walkthrough from the current state. None once the episode is over."""
        if self.done or self._env is None:
            return None
        if not self._read_cookbook and "examine cookbook" in self._obs.admissible:
            return "examine cookbook"
        plan = self._state.policy_commands or []
        return plan[0] if plan else None

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
