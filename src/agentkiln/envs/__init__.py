"""Environments: one contract (`agentkiln.envs.base`), seven families, one `make()`.

Family modules are imported on first use, so using one family never imports another's libraries.
Importing this package registers every family with gymnasium as `agentkiln/<family>-v0`
(agentkiln.synthesis.gym_adapter, imported by gymnasium.make only: its `reset(seed)` synthesizes
the task).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import gymnasium

from agentkiln.envs.base import DEFAULT_MAX_TURNS, Env, Observation, StepResult, TaskSpec
from agentkiln.families import FAMILIES, register_family  # noqa: F401  (family name -> "module:class" of its environment)
from agentkiln.families import _known


def env_class(family: str) -> type[Env]:
    if not _known(family):  # a plugin's family: the plugins this process inherited are loaded first
        raise ValueError(f"unknown environment family {family!r} (known: {sorted(FAMILIES)})")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


def make(task: TaskSpec, tasks_dir: str | Path | None = None, max_turns: int | None = None) -> Env:
    """The environment of one task. `tasks_dir` is where the split's files live (TextWorld's
    compiled games); `max_turns` defaults to the task's difficulty, then DEFAULT_MAX_TURNS."""
    try:
        cls = env_class(task.family)
    except ValueError as e:
        raise ValueError(f"task {task.task_id}: {e}") from None
    return cls(task, max_turns=max_turns, tasks_dir=tasks_dir)


def gym_id(family: str) -> str:
    return f"agentkiln/{family}-v0"


for _family in FAMILIES:  # by entry-point string: the adapter is imported on the first gymnasium.make
    if gym_id(_family) not in gymnasium.registry:
        gymnasium.register(gym_id(_family), entry_point="agentkiln.synthesis.gym_adapter:AgentkilnEnv",
                           kwargs={"family": _family})


__all__ = ["gym_id", "DEFAULT_MAX_TURNS", "FAMILIES", "Env", "Observation", "StepResult", "TaskSpec", "env_class", "make",
           "register_family"]
