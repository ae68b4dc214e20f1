"""The environment contract on real compiled TextWorld games (two games, built once per module)."""

from __future__ import annotations

import random
from dataclasses import asdict, replace

import pytest

from agentkiln.envs import Observation, StepResult, TaskSpec, make
from agentkiln.envs.textworld_env import clean
from agentkiln.synthesis import resolve
from agentkiln.synthesis.textworld_games import SERIAL, SERIAL_AT, candidate

GARBAGE = ["", "xyzzy", "go" * 1000, "\x00\n;rm -rf /", "Go East", "  take coin ", "été ☃ 🎲", "examine coin"]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    specs = {
        # level 105: a 5-step route with dead ends, so there are wrong moves to make
        "coin": (resolve("textworld", "medium", coin_levels=[105, 105]), 7),
        "cooking": (resolve("textworld", "easy", game="cooking"), 11),
    }
    tasks = {name: candidate(seed, knobs, root) for name, (knobs, seed) in specs.items()}
    data = dict(tasks["coin"].data)
    assert set(data.pop("file_sha256")) == {"games/tw-7.z8", "games/tw-7.json"}  # sealed (tests/test_game_files.py)
    assert data == {"game": "coin_collector", "game_file": "games/tw-7.z8", "level": 105}
    # the story file's serial is fixed, not the day it was compiled: the same bytes on every day
    assert all((root / "games" / f"tw-{seed}.z8").read_bytes()[SERIAL_AT] == SERIAL for _, seed in specs.values())
    return root, tasks


def _play(env, actions):
    obs = env.reset()
    texts = [obs.text]
    for a in actions:
        texts.append(env.step(a).observation.text)
    return texts


def expert_episode(env):
    """(observation, action, result) per expert step from a fresh reset."""
    obs, steps = env.reset(), []
    while (a := env.expert_action()) is not None:
        steps.append((obs, a, env.step(a)))
        obs = steps[-1][2].observation
    return steps


def expert_results_from_here(env):
    out = []
    while (a := env.expert_action()) is not None:
        out.append(env.step(a))
    return out


@pytest.mark.parametrize("name", ["coin", "cooking"])
def test_reset_gives_clean_observation_and_goal(games, name):
    root, tasks = games
    env = make(tasks[name], root, max_turns=30)
    obs = env.reset()
    assert isinstance(obs, Observation) and obs.text and obs.anchor
    assert obs.admissible and obs.admissible == sorted(obs.admissible)
    assert not {"look", "inventory"} & set(obs.admissible)
    assert all(a == "examine cookbook" or not a.startswith("examine ") for a in obs.admissible)
    assert env.goal and env.goal not in obs.text  # the objective is in env.goal, not repeated
    for noise in ("$$", "-=", "=-", ">", "  ", "\n", "score"):
        assert noise not in obs.text and noise not in env.goal
    env.close()


@pytest.mark.parametrize("name", ["coin", "cooking"])
def test_expert_walkthrough_wins(games, name):
    root, tasks = games
    env = make(tasks[name], root, max_turns=30)
    steps = expert_episode(env)
    assert steps, "the expert must act"
    for obs, action, _ in steps:
        assert action in obs.admissible
    rewards = [res.reward for _, _, res in steps]
    assert rewards == [0.0] * (len(steps) - 1) + [1.0]
    last = steps[-1][2]
    assert last.done and last.info["won"] and not last.info["lost"] and not last.info["invalid"]
    assert last.info["turn"] == len(steps)
    assert env.expert_action() is None
    env.close()


def test_cooking_expert_reads_the_cookbook_first(games):
    root, tasks = games
    env = make(tasks["cooking"], root, max_turns=30)
    actions = [a for _, a, _ in expert_episode(env)]
    assert actions[0] == "examine cookbook" and actions.count("examine cookbook") == 1
    assert actions[-1] == "eat meal" and env.won
    env.close()


def test_the_anchor_is_the_game_state_and_reading_the_room_changes_nothing(games):
    """The anchor (GiGPO's step groups) is the game's logical state: the same after a no-op, the same for
    two plays that reach one state by different orders, different once the state changes. Reading the
    room description at reset (a `look` between a save and a restore) leaves the game as it was: a
    second reset shows the same room and the expert still wins in as many steps."""
    root, tasks = games
    env = make(tasks["cooking"], root, max_turns=30)
    start = env.reset()
    n = len(expert_episode(env))
    again = env.reset()
    assert (again.text, again.anchor, again.admissible) == (start.text, start.anchor, start.admissible)
    cookbook = env.step("examine cookbook").observation  # reading changes no fact of the game
    assert cookbook.anchor == start.anchor
    moved = next(a for a in start.admissible if a.startswith(("take ", "open ")))
    assert env.step(moved).observation.anchor != start.anchor
    env.reset()
    assert len(expert_episode(env)) == n
    env.close()


def test_invalid_actions_never_raise_and_cost_a_turn(games):
    root, tasks = games
    env = make(tasks["coin"], root, max_turns=100)
    start = env.reset()
    for turn, action in enumerate(GARBAGE + [None, 42], start=1):
        res = env.step(action)
        assert isinstance(res, StepResult)
        assert res.info["invalid"] and not res.info["won"] and res.info["turn"] == turn
        assert res.reward == 0.0 and not res.done
        assert res.observation.anchor == start.anchor and res.observation.admissible == start.admissible
        text = res.observation.text
        assert text.startswith("Invalid action") and text.isprintable() and len(text) < 300
    # the game itself never saw them: the expert's plan still wins from here
    steps = expert_results_from_here(env)
    assert steps[-1].info["won"] and steps[-1].reward == 1.0
    env.close()


def test_max_turns_ends_the_episode_without_a_win(games):
    root, tasks = games
    env = make(tasks["coin"], root, max_turns=3)
    env.reset()
    results = [env.step("xyzzy"), env.step(env.expert_action()), env.step("xyzzy")]
    assert [r.done for r in results] == [False, False, True]
    assert not results[-1].info["won"] and results[-1].info["turn"] == 3
    assert env.expert_action() is None
    after = env.step("go south")  # a finished episode stays finished
    assert after.done and after.info["turn"] == 3
    env.close()


def test_losing_ends_the_episode(games):
    root, tasks = games
    env = make(tasks["cooking"], root, max_turns=30)
    env.reset()
    for _ in range(2):  # read the cookbook, then take the ingredient
        env.step(env.expert_action())
    eat = [a for a in env.step("xyzzy").observation.admissible if a.startswith("eat ") and a != "eat meal"]
    res = env.step(eat[0])  # eating a raw ingredient spoils the recipe
    assert res.done and res.info["lost"] and not res.info["won"] and res.reward == 0.0
    env.close()


@pytest.mark.parametrize("name", ["coin", "cooking"])
def test_same_actions_same_observations(games, name):
    root, tasks = games
    rng = random.Random(0)
    env = make(tasks[name], root, max_turns=12)
    obs, actions = env.reset(), []
    while len(actions) < 12:  # a random admissible walk, avoiding an early win
        choices = [a for a in obs.admissible if a not in ("take coin", "eat meal")] or obs.admissible
        actions.append(rng.choice(choices))
        res = env.step(actions[-1])
        obs = res.observation
        if res.done:
            break
    first = _play(env, actions)
    env.close()
    again = make(tasks[name], root, max_turns=12)
    assert _play(again, actions) == first
    again.close()


def test_make_validates_the_task(games, tmp_path):
    root, tasks = games
    with pytest.raises(FileNotFoundError, match="re-run synthesize"):
        make(tasks["coin"], tmp_path, max_turns=5)
    with pytest.raises(ValueError, match="unknown environment family"):
        make(replace(tasks["coin"], family="alfworld"), root, max_turns=5)
    with pytest.raises(ValueError, match="needs tasks_dir"):
        make(tasks["coin"])
    assert TaskSpec(**asdict(tasks["coin"])) == tasks["coin"]  # manifests round-trip


def test_clean_strips_textworld_decorations():
    raw = (
        "\n\n  ________  ________\n |        \\|        \\\n  \\$$$$$$$$| $$$$$$$$\n\n"
        "-= Study =-\nYou've just walked   into a study.\n\nYour score has just gone up by one point.\n"
        "\n        *** The End ***\n\nYou scored 1 out of a possible 1, in 2 turns.\n\n"
        "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?\n>     -= Study =-0/1"
    )
    assert clean(raw) == "Study. You've just walked into a study."
    assert clean("You eat it.\n\n*** You lost! ***\n>  -= Kitchen =-1/3") == "You eat it. You lost!"
