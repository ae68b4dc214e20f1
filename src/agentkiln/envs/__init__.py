"""The environment contract every family and the rollout engine use.

    task = TaskSpec(...)                   # an entry of a split manifest (JSON-serialisable)
    env = make(task, tasks_dir, max_turns)
    obs = env.reset()                      # Observation(text, admissible, anchor); env.goal
    res = env.step("go east")              # StepResult(observation, reward, done, info)
    env.expert_action()                    # the oracle's next action, or None when done
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentkiln.envs.textworld_env import Observation, StepResult, TextWorldEnv


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    family: str  # "textworld"
    game_type: str  # the game type's name in params.yaml
    game_file: str  # relative to the tasks directory
    seed: int
    difficulty: dict = field(default_factory=dict)
    expert_steps: int = 0


def make(task: TaskSpec, tasks_dir: str | Path, max_turns: int) -> TextWorldEnv:
    if task.family != "textworld":
        raise ValueError(f"task {task.task_id}: unknown environment family {task.family!r}")
    path = Path(tasks_dir) / task.game_file
    if not path.is_file():
        raise FileNotFoundError(f"task {task.task_id}: game file {path} is missing (re-run synthesize)")
    return TextWorldEnv(path, max_turns)


__all__ = ["Observation", "StepResult", "TaskSpec", "TextWorldEnv", "make"]
