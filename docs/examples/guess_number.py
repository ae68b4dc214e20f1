"""A toy environment family from outside agentkiln: guess a hidden number, told "higher" or "lower".

A plugin module: listed in params.yaml's `plugins` (`plugins: [docs/examples/guess_number.py]`), it
registers the family `guess-number` when imported. This one file is both the environment (an
agentkiln.envs.Env) and its task generator (LEVELS, check, candidate: agentkiln.synthesis.generate's
contract); `agentkiln.synthesis.contract.check_family("guess-number")` checks it as the built-in families
are checked. docs/extending.md walks through it.
"""

from __future__ import annotations

import random
import sys

from agentkiln.envs import Env, Observation, StepResult, TaskSpec, register_family
from agentkiln.envs.base import anchor_of

FAMILY = "guess-number"
VERSION = ""  # versions of the libraries its tasks depend on (none)
LEVELS = {  # difficulty knobs: the range the number is drawn from, the turn limit
    "easy": {"high": 8, "max_turns": 6},
    "medium": {"high": 16, "max_turns": 8},
    "hard": {"high": 32, "max_turns": 10},
}


def check(knobs: dict) -> None:
    """Refuse a bad knob by name (params.yaml is checked with it at load)."""
    if type(knobs.get("high")) is not int or not 2 <= knobs["high"] <= 100:
        raise ValueError(f"{FAMILY}: knob high = {knobs.get('high')!r}: must be an int in [2, 100]")
    if type(knobs.get("max_turns")) is not int or not 1 <= knobs["max_turns"] <= 100:
        raise ValueError(f"{FAMILY}: knob max_turns = {knobs.get('max_turns')!r}: must be an int in [1, 100]")


def candidate(seed: int, knobs: dict, out_dir=None) -> TaskSpec | None:
    """One task from one seed: everything the environment needs goes in `data`."""
    check(knobs)
    return TaskSpec(task_id=f"{FAMILY}-{seed}", family=FAMILY, seed=seed,
                    data={"secret": random.Random(seed).randint(1, knobs["high"]), "high": knobs["high"]})


class GuessNumberEnv(Env):
    family = FAMILY

    def _reset(self) -> Observation:
        self.secret, self.high = self.task.data["secret"], self.task.data["high"]
        self.low, self.top = 1, self.high  # what the feedback so far allows (the expert's interval)
        self.goal = f"Guess the hidden number between 1 and {self.high}."
        return self._observe("Make your first guess.")

    def _observe(self, text: str) -> Observation:
        actions = sorted(f"guess {n}" for n in range(1, self.high + 1))  # the contract: sorted, as every family's
        return Observation(text, actions, anchor_of(FAMILY, self.secret, self.low, self.top))

    def _step(self, action: str) -> StepResult:
        parts = action.strip().split()
        if len(parts) != 2 or parts[0] != "guess" or not parts[1].isdigit() or not 1 <= int(parts[1]) <= self.high:
            return self.invalid(action, f"say guess N with N from 1 to {self.high}")
        n = int(parts[1])
        if n == self.secret:
            return StepResult(self._observe(f"{n} is right!"), 1.0, True, {"won": True, "invalid": False})
        if n < self.secret:
            self.low = max(self.low, n + 1)
        else:
            self.top = min(self.top, n - 1)
        return StepResult(self._observe(f"{n} is too {'low' if n < self.secret else 'high'}."), 0.0, False,
                          {"won": False, "invalid": False})

    def _expert(self) -> str | None:
        return f"guess {(self.low + self.top) // 2}"  # binary search over what the feedback allows


register_family(FAMILY, env=GuessNumberEnv, generator=sys.modules[__name__])
