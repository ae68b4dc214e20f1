"""`generate(family, n, seed, **difficulty)`: seeded, verified, deduplicated tasks of one family.

Each family's generator module (agentkiln.families.GENERATORS) provides:
    LEVELS: dict[str, dict]              # "easy" / "medium" / "hard" -> difficulty knobs
    check(knobs) -> None                 # raise ValueError naming a bad knob value
    candidate(seed, knobs, out_dir) -> TaskSpec | None   # one task from one seed (None: retry)
    VERSION: str                         # the versions of libraries it depends on ("" if none)
    SOURCES: tuple[str, ...]             # optional: other code files that shape its observations
The verification gate is the same for every family: a task is admitted only if its oracle wins it
within `max_expert_steps`, through the very environment the agents play, and its content
fingerprint (goal + first observation + expert actions) was not admitted before.

Task i of a call with seed s gets seed `s * SEED_STRIDE + k * n + i` on its k-th attempt, so seeds
never repeat within a call, and calls whose seeds differ never share a seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from agentkiln.envs import TaskSpec, make
from agentkiln.families import (  # noqa: F401  (re-exported: the generators' contract lives here)
    GENERATORS, MAX_RETRIES, SEED_STRIDE, env_version, generator, resolve)
from agentkiln.synthesis.recovery import Extras, extra_episodes

DEFAULT_MAX_EXPERT_STEPS = 60


def check_int_knobs(family: str, knobs: dict, ranges: dict[str, tuple[int, int]]) -> None:
    """The range check every generator's check() starts with: each named knob an int in [lo, hi]."""
    for name, (lo, hi) in ranges.items():
        v = knobs.get(name)
        if type(v) is not int or not lo <= v <= hi:  # type(): a bool is not a count
            raise ValueError(f"{family}: knob {name} = {v!r}: must be an int in [{lo}, {hi}]")


def play_expert(task: TaskSpec, tasks_dir: str | Path | None, max_steps: int) -> tuple[bool, str, list[dict]]:
    """Play the oracle through the agents' environment: (won, fingerprint, one row per step)."""
    env = make(task, tasks_dir, max_turns=max_steps)
    try:
        obs = env.reset()
        rows, fingerprint = [], [env.goal, obs.text]
        while (action := env.expert_action()) is not None:
            res = env.step(action)
            rows.append({"goal": env.goal, "observation": obs.text, "action": action,
                         "admissible": json.dumps(obs.admissible), "reward": float(res.reward), "done": res.done})
            fingerprint.append(action)
            obs = res.observation
            if res.done:
                break
        return env.won, hashlib.sha1("\n".join(fingerprint).encode()).hexdigest(), rows
    finally:
        env.close()


def build(family: str, task_id: str, task_type: str, seed: int, knobs: dict, out_dir: str | Path | None,
          max_expert_steps: int, extras: Extras = Extras()) -> dict:
    """One candidate task, verified: {"task": TaskSpec | None, "rows": expert rows, "extra": recovery
    and alternative episodes (synthesis.recovery), "dropped": extra episodes not kept}. Runs in
    synthesis workers, so it takes and returns only picklable values."""
    task = generator(family).candidate(seed, dict(knobs), Path(out_dir) if out_dir is not None else None)
    if task is None:
        return {"task": None, "rows": [], "extra": [], "dropped": 0, "reason": "generator"}
    task = replace(task, task_id=task_id, task_type=task_type, difficulty=dict(knobs))
    won, fingerprint, rows = play_expert(task, out_dir, max_expert_steps)
    if not won:
        return {"task": None, "rows": [], "extra": [], "dropped": 0, "reason": "unwinnable"}
    extra, dropped = extra_episodes(task, out_dir, max_expert_steps, rows, extras)
    return {"task": replace(task, expert_steps=len(rows), fingerprint=fingerprint), "rows": rows, "extra": extra,
            "dropped": dropped, "reason": None}


def task_seed(seed: int, n: int, i: int, attempt: int) -> int:
    return seed * SEED_STRIDE + attempt * n + i


def generate(family: str, n: int, seed: int, level: str = "easy", out_dir: str | Path | None = None,
             max_expert_steps: int = DEFAULT_MAX_EXPERT_STEPS, **overrides) -> list[TaskSpec]:
    """`n` verified, distinct tasks of `family` at `level` (knobs overridable by keyword).
    Families with task files (TextWorld) write them under `out_dir`."""
    if n * (MAX_RETRIES + 1) > SEED_STRIDE:
        raise ValueError(f"n = {n}: at most {SEED_STRIDE // (MAX_RETRIES + 1)} tasks per call (seed range)")
    knobs = resolve(family, level, **overrides)
    tasks, seen = [], set()
    for i in range(n):
        for attempt in range(MAX_RETRIES + 1):
            res = build(family, f"{family}-{level}-{seed}-{i:04d}", level, task_seed(seed, n, i, attempt),
                        knobs, out_dir, max_expert_steps)
            task = res["task"]
            if task is not None and task.fingerprint not in seen:
                seen.add(task.fingerprint)
                tasks.append(task)
                break
        else:
            raise RuntimeError(f"{family} {level}: task {i}: no winnable, unseen task in {MAX_RETRIES + 1} seeds; "
                               "widen its difficulty or raise max_expert_steps")
    return tasks
