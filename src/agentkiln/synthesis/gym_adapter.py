"""Every family as a gymnasium environment, registered as `agentkiln/<family>-v0`.

    import gymnasium as gym
    import agentkiln.envs                                   # registers the seven ids
    env = gym.make("agentkiln/sokoban-v0", level="easy")
    obs, info = env.reset(seed=3)                           # seed -> the task (same seed, same episode)
    obs, reward, terminated, truncated, info = env.step(info["admissible_actions"][0])

The adapter wraps the project's own contract (agentkiln.envs.base.Env) without changing it, so
rollouts and the gym API see the same episodes. Observations and actions are text
(`TextSpace`: any string up to a length). `reset(seed=s)` builds the task the synthesizer builds for
(family, level, seed s); `options={"task": TaskSpec or its dict}` plays a given task instead
(`tasks_dir` for families with task files). `terminated`: the task ended (won or a terminal
state); `truncated`: the turn limit ran out first. `info` carries `admissible_actions` (None for
free-form tool families, whose `info["tools"]` lists the `name[argument]` tools), `won`, `invalid`,
`turn`, `goal` and `task_id`.
"""

from __future__ import annotations

import shutil
import string
import tempfile
from pathlib import Path

import gymnasium
from gymnasium import spaces

from agentkiln.envs import env_class, make
from agentkiln.envs.base import Env, Observation, TaskSpec
from agentkiln.families import SEED_STRIDE
from agentkiln.synthesis import generate

MAX_TEXT = 100_000  # longer than any observation a family renders (a SQL schema, a shop page)
LEVELS = ("easy", "medium", "hard")
# A seed picks the synthesizer's task seed s * SEED_STRIDE + ..., which must stay a 32-bit seed
# for the families built on numpy's legacy RNG (TextWorld)
MAX_SEED = (2**32 - 1) // SEED_STRIDE - 1


class TextSpace(spaces.Text):
    """Any string of at most `max_length` characters (observations quote model output, so no
    charset can be promised); samples are printable ASCII, which every family must survive."""

    def __init__(self, max_length: int = MAX_TEXT, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"


class AgentkilnEnv(gymnasium.Env):
    """One family behind the gymnasium API (see the module docstring)."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}  # fps: how fast a watcher is shown turns

    def __init__(self, family: str, level: str = "easy", max_turns: int | None = None,
                 tasks_dir: str | Path | None = None, render_mode: str | None = None):
        self.family_cls = env_class(family)
        if level not in LEVELS:
            raise ValueError(f"agentkiln/{family}-v0: level {level!r} is not one of {LEVELS}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"agentkiln/{family}-v0: render_mode {render_mode!r}: only 'ansi' (text) is offered")
        self.family, self.level, self.max_turns, self.render_mode = family, level, max_turns, render_mode
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else None
        self.observation_space = TextSpace()
        self.action_space = TextSpace(max_length=4096)
        self._env: Env | None = None
        self._obs: Observation | None = None
        self._tmp: str | None = None  # task files of generated tasks (TextWorld's compiled games)
        self._generated: dict[int, TaskSpec] = {}  # seed -> task: a game is compiled once per seed

    # -- gymnasium API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        task = options.pop("task", None)
        if options:
            raise ValueError(f"agentkiln/{self.family}-v0: unknown reset option(s) {sorted(options)} (known: task)")
        if task is not None:
            task = task if isinstance(task, TaskSpec) else TaskSpec(**task)
            if task.family != self.family:
                raise ValueError(f"agentkiln/{self.family}-v0: task {task.task_id} is of family {task.family}")
            tasks_dir = self.tasks_dir
        elif seed is not None or self._env is None:
            # no seed on a first reset: a task from the env's own RNG (seeded by gymnasium)
            task_seed = seed if seed is not None else int(self.np_random.integers(0, MAX_SEED + 1))
            if not 0 <= task_seed <= MAX_SEED:
                raise ValueError(f"agentkiln/{self.family}-v0: reset(seed={seed}): a task seed is in [0, {MAX_SEED}]")
            task, tasks_dir = self._generate(task_seed)
        else:  # reset() again: the same task
            task, tasks_dir = self._env.task, self._env.tasks_dir
        if self._env is not None:
            self._env.close()
        self._env = make(task, tasks_dir=tasks_dir, max_turns=self.max_turns)
        self._obs = self._env.reset()
        return self._obs.text, self._info({"won": False, "invalid": False, "turn": 0})

    def step(self, action):
        if self._env is None:
            raise RuntimeError(f"agentkiln/{self.family}-v0: call reset() before step()")
        res = self._env.step(action)
        self._obs = res.observation
        truncated = bool(self._env.truncated)
        terminated = bool(res.done) and not truncated
        return res.observation.text, float(res.reward), terminated, truncated, self._info(res.info)

    def render(self):
        if self.render_mode == "ansi" and self._obs is not None:
            return f"[{self.family} turn {self._env.turn}] {self._env.goal}\n{self._obs.text}\n"
        return None

    def close(self):
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp, self._generated = None, {}

    # -- helpers ------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The oracle's next action (for demos and tests), or None when the episode is over."""
        return self._env.expert_action() if self._env is not None else None

    @property
    def task(self) -> TaskSpec | None:
        return self._env.task if self._env is not None else None

    def _generate(self, seed: int) -> tuple[TaskSpec, Path | None]:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix=f"agentkiln-gym-{self.family}-")
        if seed not in self._generated:
            self._generated[seed] = generate(self.family, 1, seed=seed, level=self.level, out_dir=self._tmp)[0]
        return self._generated[seed], Path(self._tmp)

    def _info(self, step_info: dict) -> dict:
        info = dict(step_info)
        info.update(admissible_actions=list(self._obs.admissible) if self._obs.admissible is not None else None,
                    goal=self._env.goal, task_id=self._env.task.task_id, family=self.family)
        if self.family_cls.free_form:
            info["tools"] = [f"{name}[{arg}]" for name, arg, _ in self.family_cls.tools]
        return info


__all__ = ["AgentkilnEnv", "TextSpace"]
