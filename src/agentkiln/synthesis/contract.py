"""The environment contract as a check a new family must pass (agentkiln.envs.base lists the rules).

    from agentkiln.synthesis.contract import check_family
    check_family("guess-number")          # raises ContractError naming the broken rule; returns what it checked

A family registered from your own code (agentkiln.families.register_family) is checked as the built-in
ones are in tests/test_env_contract.py: its levels are distinct and its knobs validated; every generated
task is won by its expert through the agents' environment, survives a JSON round trip and is distinct;
the same seed gives the same tasks and the same observations; seeded random and adversarial actions
never raise, always answer a StepResult with `won`, `invalid` and `turn` and a reward in [0, 1], a
non-string action is invalid, a finished episode stays finished; an episode ends at `max_turns`.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import asdict
from pathlib import Path

from agentkiln.envs import Observation, StepResult, TaskSpec, make
from agentkiln.envs.fuzz import fuzz_action
from agentkiln.synthesis.generate import generate, generator, play_expert, resolve

LEVELS = ("easy", "medium", "hard")


class ContractError(AssertionError):
    """A family breaks a rule of the environment contract: the message names the family and the rule."""


def _require(ok: bool, family: str, rule: str) -> None:
    if not ok:
        raise ContractError(f"{family}: {rule}")


def check_family(family: str, n: int = 6, seed: int = 7, fuzz_steps: int = 500,
                 tasks_dir: str | Path | None = None) -> dict:
    """Check `family` against the contract on `n` tasks per level; {level: tasks checked, "fuzz": steps}."""
    with tempfile.TemporaryDirectory(prefix=f"contract-{family}-") as tmp:
        out = Path(tasks_dir or tmp)
        gen = generator(family)
        _require(set(LEVELS) <= set(gen.LEVELS), family, f"LEVELS must define {', '.join(LEVELS)}")
        knobs = [json.dumps(resolve(family, level), sort_keys=True) for level in LEVELS]
        _require(len(set(knobs)) == len(LEVELS), family, "its levels must differ in some knob")
        for bad in ({"level": "impossible"}, {"no_such_knob": 1}):
            try:
                resolve(family, bad.pop("level", "easy"), **bad)
            except ValueError:
                continue
            raise ContractError(f"{family}: resolve must refuse an unknown level or knob by name")
        report: dict = {}
        tasks_by_level = {}
        for level in LEVELS:
            tasks = generate(family, n, seed=seed, level=level, out_dir=out / level)
            _require(len({t.fingerprint for t in tasks}) == len(tasks), family, f"{level}: tasks must be distinct")
            for t in tasks:
                _require(t.family == family, family, f"a task's family is {t.family!r}")
                _require(TaskSpec(**json.loads(json.dumps(asdict(t)))) == t, family,
                         f"task {t.task_id} must survive a JSON round trip (its data plain JSON)")
                won, fingerprint, rows = play_expert(t, out / level, max_steps=200)
                _require(won and fingerprint == t.fingerprint and len(rows) == t.expert_steps, family,
                         f"task {t.task_id}: its expert must win it the same way every time")
            tasks_by_level[level] = tasks
            report[level] = len(tasks)
        again = generate(family, n, seed=seed, level="easy", out_dir=out / "again")
        _require([asdict(t) for t in again] == [asdict(t) for t in tasks_by_level["easy"]], family,
                 "the same seed must give the same tasks")
        easy = tasks_by_level["easy"]
        for task in easy[:3]:
            actions = _seeded_actions(task, out / "easy")
            _require(_replay(task, out / "easy", actions) == _replay(task, out / "easy", actions), family,
                     f"task {task.task_id}: the same actions must give the same observations")
        report["fuzz"] = _fuzz(family, tasks_by_level["medium"], out / "medium", fuzz_steps)
        env = make(easy[0], out / "easy", max_turns=3)
        env.reset()
        results = [env.step("\x00 not an action \x00") for _ in range(3)]
        _require([r.done for r in results] == [False, False, True] and [r.info["turn"] for r in results] == [1, 2, 3]
                 and all(r.info["invalid"] and not r.info["won"] for r in results), family,
                 "garbage actions must be invalid steps and the episode must end at max_turns")
        _require(env.expert_action() is None, family, "a finished episode has no expert action")
    return report


def _seeded_actions(task: TaskSpec, tasks_dir: Path) -> list:
    env = make(task, tasks_dir)
    obs, actions, rng = env.reset(), [], random.Random(0)
    for _ in range(15):  # a seeded mix of valid and expert actions
        a = rng.choice(obs.admissible) if obs.admissible and rng.random() < 0.8 else env.expert_action() or "x"
        actions.append(a)
        res = env.step(a)
        obs = res.observation
        if res.done:
            break
    return actions


def _replay(task: TaskSpec, tasks_dir: Path, actions: list) -> list:
    env = make(task, tasks_dir)
    obs = env.reset()
    seq = [(obs.text, obs.admissible, obs.anchor)]
    for a in actions:
        r = env.step(a)
        seq.append((r.observation.text, r.observation.admissible, r.observation.anchor, r.reward, r.done,
                    json.dumps(r.info, sort_keys=True, default=str)))
    return seq


def _fuzz(family: str, tasks: list[TaskSpec], tasks_dir: Path, steps: int) -> int:
    rng = random.Random(1234)
    env = make(tasks[0], tasks_dir, max_turns=60)
    obs = env.reset()
    for k in range(steps):
        a = fuzz_action(rng, obs.admissible)
        try:
            res = env.step(a)
        except Exception as e:  # noqa: BLE001  (the rule is that nothing an agent says raises)
            raise ContractError(f"{family}: step({str(a)[:40]!r}) raised {type(e).__name__}: {e}") from None
        _require(isinstance(res, StepResult) and isinstance(res.observation, Observation)
                 and isinstance(res.observation.text, str) and bool(res.observation.text), family,
                 "step must return a StepResult whose observation has text")
        _require({"won", "invalid", "turn"} <= set(res.info), family, "info must hold won, invalid and turn")
        _require(isinstance(res.reward, float) and 0.0 <= res.reward <= 1.0, family, "reward must be a float in [0, 1]")
        _require(isinstance(a, str) or res.info["invalid"], family, "a non-string action must be invalid")
        obs = res.observation
        if res.done:
            _require(env.step("anything").info["invalid"], family, "a finished episode must stay finished")
            env = make(tasks[k % len(tasks)], tasks_dir, max_turns=60)
            obs = env.reset()
    return steps
