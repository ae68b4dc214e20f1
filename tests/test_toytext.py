"""gym-toytext: FrozenLake and Taxi on hand-checked states (gymnasium's 4x4 map, a known Taxi
trip), rendering, holes, no-op actions, invalid actions, equality with gymnasium's own step(), and
the generator's knobs (either game at any level)."""

from __future__ import annotations

import random

import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv
from gymnasium.envs.toy_text.taxi import TaxiEnv

from agentkiln.envs import TaskSpec, make
from agentkiln.envs.toytext import LAKE_ACTIONS, TAXI_ACTIONS, lake_model, taxi_model
from agentkiln.synthesis import generate
from agentkiln.synthesis import toytext as gen
from agentkiln.synthesis.generate import resolve

LAKE = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's "4x4" map


def lake(rows=LAKE, max_turns=20):
    env = make(TaskSpec("t", "gym-toytext", 0, difficulty={"max_turns": max_turns},
                        data={"game": "frozenlake", "map": rows}))
    return env, env.reset()


def taxi(start, max_turns=30):
    env = make(TaskSpec("t", "gym-toytext", 0, difficulty={"max_turns": max_turns},
                        data={"game": "taxi", "start": start}))
    return env, env.reset()


def test_lake_render_of_the_start():
    env, obs = lake()
    assert obs.text == ("You stand on the ice at the start.\n@ F F F\nF H F H\nF F F H\nH F F G\n"
                        "You are at row 0 col 0. Around you: down ice, left edge, right ice, up edge.")
    assert obs.admissible == ["down", "left", "right", "up"]
    assert "S start, F ice, H hole, G goal, @ you" in env.goal


def test_lake_oracle_walks_the_hand_checked_shortest_path():
    env, _ = lake()
    actions = []
    while (a := env.expert_action()) is not None:
        actions.append(a)
        res = env.step(a)
    # 6 = 2 * (4 - 1) moves; ties go to the first action in sorted order (down before right)
    assert actions == ["down", "down", "right", "down", "right", "right"]
    assert (res.reward, res.done, res.info["won"]) == (1.0, True, True)
    assert res.observation.text.startswith("You walk right and reach the goal. You won.")
    assert lake_model(tuple(LAKE)).dist[0] == 6


def test_lake_hole_ends_the_episode_lost_and_edges_are_no_ops():
    env, start = lake()
    res = env.step("up")
    assert res.observation.text.startswith("You cannot walk up: the edge of the lake.")
    assert not res.info["invalid"] and res.observation.anchor == start.anchor and res.info["turn"] == 1
    env.step("right")
    res = env.step("down")  # (1, 1) is a hole
    assert (res.reward, res.done, res.info["won"], res.info["lost"]) == (0.0, True, False, True)
    assert "fall into a hole. You lost." in res.observation.text
    assert env.expert_action() is None


def test_invalid_actions_name_the_game_and_its_actions():
    env, obs = lake()
    res = env.step("pickup")
    assert res.observation.text == ('Invalid action "pickup": not a frozenlake action. '
                                    "Valid actions: down, left, right, up.")
    assert res.info["invalid"] and res.observation.anchor == obs.anchor
    env, _ = taxi(1)
    assert env.step("Down").observation.text.endswith("Valid actions: dropoff, east, north, pickup, south, west.")


def test_taxi_known_trip_is_ten_steps():
    # taxi at R (0, 0), passenger at R, destination G (0, 4): pickup, 8 moves around the wall, dropoff
    start = TaxiEnv().encode(0, 0, 0, 1)
    assert taxi_model().dist[start] == 10
    env, obs = taxi(start)
    assert obs.text == ("Your taxi is ready. Taxi at row 0 col 0. Passenger waiting at R (row 0 col 0). "
                        "Destination G (row 0 col 4). Blocked: north, west.")
    actions = []
    while (a := env.expert_action()) is not None:
        actions.append(a)
        res = env.step(a)
    assert len(actions) == 10 and actions[0] == "pickup" and actions[-1] == "dropoff"
    assert (res.reward, res.done, res.info["won"]) == (1.0, True, True)
    assert "Passenger delivered." in res.observation.text


def test_taxi_pickup_and_dropoff_feedback():
    e = TaxiEnv()
    env, _ = taxi(e.encode(2, 2, 0, 1))
    res = env.step("pickup")
    assert res.observation.text.startswith("There is no passenger here to pick up.") and not res.info["invalid"]
    assert res.reward == 0.0 and not res.done
    env, _ = taxi(e.encode(0, 0, 0, 1))
    env.step("pickup")
    for a in ["south", "south", "south", "south"]:  # down column 0 to Y (4, 0)
        env.step(a)
    res = env.step("dropoff")
    assert res.observation.text.startswith("The passenger gets out at Y, not the destination.")
    assert "Passenger waiting at Y" in res.observation.text and not res.done
    res = env.step("east")  # a wall east of Y
    assert res.observation.text.startswith("You cannot drive east: a wall.")


@pytest.mark.parametrize("game", ["frozenlake", "taxi"])
def test_dynamics_equal_gymnasiums_step(game):
    rng = random.Random(3)
    for episode in range(20):
        if game == "taxi":
            ref = TaxiEnv()
            s0, _ = ref.reset(seed=episode)
            env, _ = taxi(int(s0), max_turns=100)
            names = TAXI_ACTIONS
        else:
            ref = FrozenLakeEnv(desc=LAKE, is_slippery=False)
            ref.reset(seed=episode)
            env, _ = lake(max_turns=100)
            names = LAKE_ACTIONS
        for _ in range(40):
            a = rng.randrange(len(names))
            s, r, term, _, _ = ref.step(a)
            res = env.step(names[a])
            assert env.s == s and res.done == term and (res.reward == 1.0) == (term and r > 0)
            if term:
                break


def test_knobs_are_checked_and_either_game_plays_at_any_level():
    for bad, name in [({"game": "chess"}, "game"), ({"lake_size": 2}, "lake_size"),
                      ({"lake_hole_p": 0.9}, "lake_hole_p"), ({"lake_hole_p": "0.1"}, "lake_hole_p"),
                      ({"taxi_min_steps": 12, "taxi_max_steps": 10}, "taxi_max_steps"),
                      ({"lake_min_steps": 15}, "lake_min_steps"), ({"max_turns": 3}, "max_turns")]:
        with pytest.raises(ValueError, match=name):
            resolve("gym-toytext", "easy", **bad)
    hard_lake = resolve("gym-toytext", "hard", game="frozenlake")
    assert (hard_lake["game"], hard_lake["lake_size"]) == ("frozenlake", 8)
    tasks = generate("gym-toytext", 3, seed=2, level="hard", game="frozenlake")
    assert all(t.data["game"] == "frozenlake" and len(t.data["map"]) == 8 for t in tasks)
    assert all(t.expert_steps == t.data["optimal_steps"] >= 16 for t in tasks)
    tasks = generate("gym-toytext", 3, seed=2, level="easy", game="taxi")
    assert all(t.data["game"] == "taxi" and 6 <= t.expert_steps <= 10 for t in tasks)
    assert gen.candidate(5, resolve("gym-toytext", "medium")) == gen.candidate(5, resolve("gym-toytext", "medium"))
