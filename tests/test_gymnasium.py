"""Every family is a gymnasium environment (agentkiln.synthesis.gym_adapter): registered as
`agentkiln/<family>-v0`, passing gymnasium's own check_env, reproducible by reset(seed=...),
telling terminated (the task ended) from truncated (the turn limit ran out)."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from agentkiln.envs import FAMILIES, gym_id
from agentkiln.synthesis.gym_adapter import MAX_SEED
from agentkiln.synthesis import generate

FAMILY_NAMES = sorted(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_check_env_passes_and_make_by_id(family):
    env = gym.make(gym_id(family))  # gymnasium's passive checker wraps it too
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker warning is a failure here
            check_env(env.unwrapped)
        obs, info = env.reset(seed=5)
        assert isinstance(obs, str) and obs and info["family"] == family and info["turn"] == 0
        if env.unwrapped.family_cls.free_form:
            assert info["admissible_actions"] is None and all(t.endswith("]") for t in info["tools"])
        else:
            assert info["admissible_actions"] == sorted(info["admissible_actions"]) and info["admissible_actions"]
    finally:
        env.close()


@pytest.mark.parametrize("family", ["sokoban", "gym-toytext", "shop"])
def test_same_seed_same_episode_other_seed_other_task(family):
    def episode(seed):
        env = gym.make(gym_id(family))
        obs, info = env.reset(seed=seed)
        seen = [obs]
        for _ in range(4):
            action = (info["admissible_actions"] or ["noop"])[-1]
            obs, reward, terminated, truncated, info = env.step(action)
            seen.append((obs, reward, terminated, truncated))
        task = env.unwrapped.task.task_id, env.unwrapped.task.fingerprint
        env.close()
        return seen, task

    a, task_a = episode(11)
    b, task_b = episode(11)
    assert a == b and task_a == task_b
    _, task_c = episode(12)
    assert task_c[1] != task_a[1]


def test_expert_wins_terminated_and_turn_limit_truncates():
    env = gym.make(gym_id("sokoban"), max_turns=40)
    obs, info = env.reset(seed=2)
    terminated = truncated = False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = env.step(env.unwrapped.expert_action())
    assert terminated and not truncated and info["won"] and reward == 1.0
    env.close()

    env = gym.make(gym_id("sokoban"), max_turns=3)  # gymnasium.make's own TimeLimit is not used: the env counts turns
    env.reset(seed=2)
    results = [env.step("not an action") for _ in range(3)]
    assert [r[2:4] for r in results] == [(False, False), (False, False), (False, True)]
    assert all(r[4]["invalid"] for r in results)
    env.close()


def test_reset_options_play_a_given_task(tmp_path):
    task = generate("gym-toytext", 2, seed=3, level="easy")[1]
    env = gym.make(gym_id("gym-toytext"))
    obs, info = env.reset(options={"task": task})
    assert info["task_id"] == task.task_id
    obs2, _ = env.reset()  # reset() again: the same task from its start
    assert obs2 == obs and env.unwrapped.task == task
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"level": "hard"})
    with pytest.raises(ValueError, match="is of family gym-toytext"):
        gym.make(gym_id("sokoban")).reset(options={"task": task})
    with pytest.raises(ValueError, match=rf"\[0, {MAX_SEED}\]"):
        env.reset(seed=MAX_SEED + 1)
    env.close()
