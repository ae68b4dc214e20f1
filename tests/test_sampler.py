"""The RL task sampler: balanced shares, learnability weighting, decks, and its checkpointed state."""

import random
from collections import Counter

import pytest

from agentkiln.envs import TaskSpec
from agentkiln.trainers.sampler import TaskSampler, apportion


def pool(counts: dict[str, int]) -> list[TaskSpec]:
    return [TaskSpec(f"{t}-{i}", "fam", i, task_type=t) for t, n in counts.items() for i in range(n)]


def test_apportion_is_proportional_and_rotates_the_odd_task():
    rng = random.Random(0)
    got = [apportion({"a": 1, "b": 1, "c": 1}, 8, rng) for _ in range(30)]
    assert all(sum(c.values()) == 8 and sorted(c.values()) == [2, 3, 3] for c in got)
    assert {min(c, key=c.get) for c in got} == {"a", "b", "c"}  # each type is sometimes the short one
    assert apportion({"a": 3, "b": 1}, 8, rng) == {"a": 6, "b": 2}


def test_uniform_draws_as_before():
    tasks = pool({"a": 10, "b": 10})
    assert TaskSampler(tasks).sample(8, random.Random(5)) == random.Random(5).sample(tasks, 8)


def test_balanced_gives_every_type_its_share_whatever_the_pool_holds():
    tasks = pool({"big": 60, "small": 4})
    s = TaskSampler(tasks, "balanced")
    rng = random.Random(1)
    for _ in range(10):
        got = Counter(t.task_type for t in s.sample(8, rng))
        assert got == {"big": 4, "small": 4}
    s = TaskSampler(tasks, "balanced", mix={"big": 3, "small": 1})
    assert Counter(t.task_type for t in s.sample(8, rng)) == {"big": 6, "small": 2}


def test_decks_play_every_task_before_repeating_one():
    tasks = pool({"a": 6, "b": 6})
    s = TaskSampler(tasks, "balanced")
    rng = random.Random(2)
    seen = [t.task_id for _ in range(3) for t in s.sample(4, rng)]  # 3 x 2 of each type = one deck each
    assert len(seen) == len(set(seen)) == 12
    one = s.sample(4, rng)
    assert len({t.task_id for t in one}) == 4


def test_learnability_prefers_types_neither_solved_nor_hopeless():
    tasks = pool({"solved": 20, "learning": 20, "hopeless": 20})
    s = TaskSampler(tasks, "learnability", min_share=0.1, success_ema=0.0)
    s.observe({"solved": [True] * 8, "learning": [True, False] * 4, "hopeless": [False] * 8})
    shares = s.shares()
    assert shares["solved"] == pytest.approx(0.1) and shares["hopeless"] == pytest.approx(0.1)
    assert shares["learning"] == pytest.approx(0.8)
    assert Counter(t.task_type for t in s.sample(10, random.Random(0))) == {"learning": 8, "solved": 1, "hopeless": 1}
    # the estimate is a moving average
    s2 = TaskSampler(tasks, "learnability", success_ema=0.5)
    s2.observe({"solved": [True]})
    s2.observe({"solved": [False]})
    assert s2.success["solved"] == pytest.approx(0.5)


def test_state_round_trip_deals_the_same_tasks():
    tasks = pool({"a": 7, "b": 5})
    s = TaskSampler(tasks, "learnability")
    rng = random.Random(3)
    s.sample(4, rng)
    s.observe({"a": [True, False], "b": [False]})
    state, rng_state = s.state_dict(), rng.getstate()
    after = [t.task_id for t in s.sample(4, rng)]
    s2 = TaskSampler(tasks, "learnability")
    s2.load_state_dict(state)
    rng2 = random.Random()
    rng2.setstate(rng_state)
    assert [t.task_id for t in s2.sample(4, rng2)] == after


def test_replay_draws_varied_tasks_by_learnability_and_fills_the_rest_fresh():
    tasks = pool({"a": 10, "b": 10})
    s = TaskSampler(tasks, "balanced", replay_share=0.5)
    # before anything is seen there is nothing to replay: every task is dealt as balanced deals it
    first = s.sample(8, random.Random(0))
    assert [t.task_id for t in first] == [t.task_id for t in TaskSampler(tasks, "balanced").sample(8, random.Random(0))]
    # a-0 and b-1 varied (a-0 at 1/2: weight 1/4; b-1 at 7/8: weight 7/64), a-1 was solved, b-0 hopeless
    s.observe({}, {"a-0": [True, False], "a-1": [True, True], "b-0": [False, False], "b-1": [True] * 7 + [False]})
    assert s.replayable() == {"a-0": 0.25, "b-1": pytest.approx(7 / 64)}
    rng = random.Random(1)
    for _ in range(20):
        got = [t.task_id for t in s.sample(8, rng)]
        assert len(set(got)) == 8
        assert set(got[:2]) == {"a-0", "b-1"}  # half of 8 = 4 asked, the only 2 replayable taken
        assert not {"a-0", "b-1"} & set(got[2:])  # the fresh tasks are other tasks
    # by p(1-p): with one slot, a-0 (1/4) comes about 70% of the time, b-1 (7/64) about 30%
    s1 = TaskSampler(tasks, "uniform", replay_share=0.25)
    s1.observe({}, {"a-0": [True, False], "b-1": [True] * 7 + [False]})
    first_pick = Counter(s1.sample(4, rng)[0].task_id for _ in range(2000))
    assert 0.64 < first_pick["a-0"] / 2000 < 0.76
    # the last group counts: a task solved now leaves the replay set; it survives a checkpoint
    s.observe({}, {"a-0": [True, True]})
    assert s.replayable() == {"b-1": pytest.approx(7 / 64)}
    s2 = TaskSampler(tasks, "balanced", replay_share=0.5)
    s2.load_state_dict(s.state_dict())
    assert s2.replayable() == s.replayable()
    # episodes of tasks outside the pool (a harness's offline split) are not remembered
    s.observe({}, {"elsewhere": [True, False]})
    assert "elsewhere" not in s.task_success


def test_an_unknown_type_in_mix_is_named():
    with pytest.raises(ValueError, match="rl.mix: task type\\(s\\) nope not in the RL pool"):
        TaskSampler(pool({"a": 2}), "balanced", mix={"nope": 1.0})
