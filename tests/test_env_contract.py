"""The environment contract, checked on every family (agentkiln/envs/base.py lists the rules).

Each family is generated at all three levels, its expert must win every admitted task, the same
seed must give the same tasks and observation sequences, and 2,000 random and adversarial actions
must never raise. TextWorld compiles games (about a second each), so it gets fewer tasks here; the
full 200-per-level check is bench/family_suite.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import pytest

from agentkiln.envs import FAMILIES, Observation, StepResult, TaskSpec, make
from agentkiln.envs.fuzz import fuzz_action
from agentkiln.synthesis import generate
from agentkiln.synthesis.generate import generator, play_expert, resolve

FAMILY_NAMES = sorted(FAMILIES)
N_PER_LEVEL = {"textworld": 2}  # others: 12
LEVELS = ["easy", "medium", "hard"]


def _n(family):
    return N_PER_LEVEL.get(family, 12)


@pytest.fixture(scope="module")
def tasks_by_family(tmp_path_factory):
    cache = {}

    def get(family, level):
        if (family, level) not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{level}")
            cache[family, level] = (generate(family, _n(family), seed=7, level=level, out_dir=out), out)
        return cache[family, level]

    return get


def _replay(env, actions):
    obs = env.reset()
    seq = [(obs.text, obs.admissible, obs.anchor)]
    for a in actions:
        r = env.step(a)
        seq.append((r.observation.text, r.observation.admissible, r.observation.anchor, r.reward, r.done,
                    json.dumps(r.info, sort_keys=True, default=str)))
    return seq


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_levels_are_distinct_and_knobs_validated(family):
    gen = generator(family)
    assert set(LEVELS) <= set(gen.LEVELS)
    knobs = [resolve(family, lvl) for lvl in LEVELS]
    assert len({json.dumps(k, sort_keys=True) for k in knobs}) == 3
    with pytest.raises(ValueError, match="no_such_knob"):
        resolve(family, "easy", no_such_knob=1)
    with pytest.raises(ValueError, match="level"):
        resolve(family, "impossible")


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("level", LEVELS)
def test_expert_wins_every_admitted_task_and_tasks_are_distinct(family, level, tasks_by_family):
    tasks, out = tasks_by_family(family, level)
    assert len(tasks) == _n(family)
    assert len({t.fingerprint for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.family == family and t.expert_steps >= 1
        assert TaskSpec(**json.loads(json.dumps(asdict(t)))) == t  # manifests round-trip through JSON
        won, fingerprint, rows = play_expert(t, out, max_steps=200)
        assert won and fingerprint == t.fingerprint and len(rows) == t.expert_steps


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_same_seed_same_tasks_and_observations(family, tasks_by_family, tmp_path):
    tasks, out = tasks_by_family(family, "easy")
    again = generate(family, _n(family), seed=7, level="easy", out_dir=tmp_path)
    assert [asdict(t) for t in again] == [asdict(t) for t in tasks]
    other = generate(family, 2, seed=8, level="easy", out_dir=tmp_path / "other")
    assert {t.fingerprint for t in other}.isdisjoint({t.fingerprint for t in tasks})
    for task in tasks[:3]:
        env = make(task, out)
        obs, actions = env.reset(), []
        rng = random.Random(0)
        for _ in range(15):  # a seeded mix of valid and random actions
            a = rng.choice(obs.admissible) if obs.admissible and rng.random() < 0.8 else env.expert_action() or "x"
            actions.append(a)
            r = env.step(a)
            obs = r.observation
            if r.done:
                break
        assert _replay(make(task, out), actions) == _replay(make(task, out), actions)
        env2 = make(task, out)
        assert env2.reset().anchor == make(task, out).reset().anchor


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fuzz_2000_actions_never_raise(family, tasks_by_family):
    tasks, out = tasks_by_family(family, "medium")
    rng = random.Random(1234)
    steps, invalid = 0, 0
    env = make(tasks[0], out, max_turns=60)
    obs = env.reset()
    while steps < 2000:
        a = fuzz_action(rng, obs.admissible)
        res = env.step(a)
        steps += 1
        assert isinstance(res, StepResult) and isinstance(res.observation, Observation)
        assert isinstance(res.observation.text, str) and res.observation.text
        assert {"won", "invalid", "turn"} <= set(res.info)
        assert isinstance(res.reward, float) and 0.0 <= res.reward <= 1.0
        if not isinstance(a, str):
            assert res.info["invalid"]
        invalid += bool(res.info["invalid"])
        obs = res.observation
        if res.done:
            assert env.step("anything").info["invalid"]  # a finished episode stays finished
            env = make(tasks[steps % len(tasks)], out, max_turns=60)
            obs = env.reset()
    assert invalid > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_episode_ends_at_max_turns(family, tasks_by_family):
    tasks, out = tasks_by_family(family, "easy")
    env = make(tasks[0], out, max_turns=3)
    env.reset()
    results = [env.step("\x00 not an action \x00") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert all(r.info["invalid"] and not r.info["won"] and r.reward == 0.0 for r in results)
    assert [r.info["turn"] for r in results] == [1, 2, 3]
    assert env.expert_action() is None
