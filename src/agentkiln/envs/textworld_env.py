"""TextWorld games behind the agentkiln environment contract.

Coin collector, treasure hunter and cooking (household, ALFWorld-like) games compiled by
agentkiln.synthesis.textworld_games; `task.data["game_file"]` is relative to the tasks directory, and
`task.data["file_sha256"]` holds the sha256 of the game's files: checked before a game starts (a
truncated game file would kill the process inside the interpreter; a changed one would play silently).
info has `lost` too (treasure hunter: the wrong object; cooking: a ruined meal). Invalid or garbage
actions never reach the game engine: they cost a turn and the observation says why.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager

import textworld

from agentkiln.artifacts import TASK_FILES_HINT, TASK_FILES_KEY, ArtifactError, verify_task_files
from agentkiln.envs.base import Env, Observation, StepResult, anchor_of

# No `description` or `inventory`: each costs the interpreter a `look` / `inventory` command (with a
# save and restore) on every step, 3.5x the cost of the step itself. The anchor is the game's facts
# (its whole logical state, tracked by TextWorld without the interpreter); the room description is
# read once, at reset.
_INFOS = textworld.EnvInfos(
    admissible_commands=True, policy_commands=True, objective=True, facts=True, won=True, lost=True, feedback=True,
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
# the text of a `look` in it, without its "[looking]" / "[looking - succeeded]" markers
_DESCRIPTION = re.compile(r"<description>\n(?:\[looking\]\n)?(.*?)\s*(?:\[looking - succeeded\]\s*)?</description>", re.S)


def clean(text: str) -> str:
    """Strip TextWorld's banner, prompts, score messages and runs of whitespace: small models read this."""
    for pat in _NOISE:
        text = pat.sub(" ", text)
    text = _ROOM.sub(r"\1.", text).replace(">", " ")
    return re.sub(r"\s+", " ", text).strip()


def _keep(cmd: str) -> bool:
    # look/inventory/examine waste turns and bloat prompts; the cookbook is the exception
    return cmd not in _META and (not cmd.startswith("examine ") or cmd == "examine cookbook")


@contextmanager
def _quiet():
    """jericho warns on loads and steps that it has no special support for TextWorld's games (no
    score or valid-action detection of its own): those features are not used here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(is not fully supported|unsupported game)")
        yield


class TextWorldEnv(Env):
    family = "textworld"

    def __init__(self, task, max_turns=None, tasks_dir=None):
        super().__init__(task, max_turns, tasks_dir)
        if self.tasks_dir is None:
            raise ValueError(f"task {task.task_id}: a TextWorld task needs tasks_dir (where its game file lives)")
        path = self.tasks_dir / task.data["game_file"]
        if not path.is_file():
            raise FileNotFoundError(f"task {task.task_id}: game file {path} is missing (re-run synthesize)")
        files = task.data.get(TASK_FILES_KEY) or {}
        if task.data["game_file"] not in files:
            raise ArtifactError(f"task {task.task_id}: no sha256 recorded for its game file {path} (made by an older "
                                f"agentkiln, or not by synthesize), so it cannot be checked; {TASK_FILES_HINT}")
        verify_task_files(task.task_id, files, self.tasks_dir, "its split manifest")
        self.game_file = str(path)
        self._env = None
        self.lost = False

    def _observe(self, text: str) -> Observation:
        # admissible_commands is the costly part of a TextWorld step: read it once per step here
        gs = self._state
        admissible = sorted(c for c in gs.admissible_commands or [] if _keep(c))
        return Observation(text=text, admissible=admissible, anchor=anchor_of(*sorted(map(str, gs.facts))))

    def _reset(self) -> Observation:
        with _quiet():
            if self._env is None:
                self._env = textworld.start(self.game_file, request_infos=_INFOS)
            self._state = self._env.reset()
        self.lost = False
        self._read_cookbook = False
        self.goal = clean(self._state.objective)
        # the room description, not the intro feedback: that repeats the objective (in env.goal)
        return self._observe(clean(self._look()))

    def _look(self) -> str:
        """The room's description as `EnvInfos(description=True)` gives it (TextWorld's games print it
        between <description> tags after `tw-extra-infos description`), asked between a save and a
        restore of the interpreter, so the game is exactly as it was and does not go on printing it."""
        jericho = self._env.unwrapped._jericho
        saved = jericho.get_state()
        text, _, _, _ = jericho.step("tw-extra-infos description")
        jericho.set_state(saved)
        found = _DESCRIPTION.search(text)
        if found is None:
            raise RuntimeError(f"{self.game_file}: the game did not print its room description (not a TextWorld game?)")
        return found.group(1)

    def _step(self, action: str) -> StepResult:
        if action not in self._obs.admissible:
            # never reaches the engine: garbage cannot crash or confuse the interpreter
            return self.invalid(action, "not one of the valid actions")
        self._read_cookbook |= action == "examine cookbook"
        with _quiet():
            self._state, _, game_over = self._env.step(action)
        won, self.lost = bool(self._state.won), bool(self._state.lost)
        obs = self._observe(clean(self._state.feedback))
        return StepResult(obs, 1.0 if won else 0.0, bool(game_over or won or self.lost), {"won": won, "lost": self.lost})

    def _expert(self) -> str | None:
        """Read the cookbook first (the shortest walkthrough skips it, so a policy imitating it
        could not know which ingredient to take), then TextWorld's walkthrough from here."""
        if not self._read_cookbook and "examine cookbook" in self._obs.admissible:
            return "examine cookbook"
        plan = self._state.policy_commands or []
        return plan[0] if plan else None

    def expert_distance(self, limit: int = 0) -> int | None:
        """TextWorld's remaining walkthrough (policy commands) from here, plus the cookbook the expert
        reads first; None once the game is lost or when there is no walkthrough."""
        if not self._started:
            return None
        if self.won:
            return 0
        plan = self._state.policy_commands
        if self.lost or not plan:
            return None
        cookbook = not self._read_cookbook and "examine cookbook" in self._obs.admissible
        return len(plan) + cookbook

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
