"""Sokoban: hand-written levels with hand-counted optimal solutions, rendering, pushes, deadlocks,
invalid moves, the oracle after deviations, and the generator's knobs and bounds."""

from __future__ import annotations

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.envs.sokoban import parse, solve
from agentkiln.synthesis import generate
from agentkiln.synthesis import sokoban as gen
from agentkiln.synthesis.generate import resolve

CORRIDOR = ["#######",
            "#@_$_.#",
            "#######"]
# box (2,2) to target (3,3): push it right from (2,1), then down from (1,3): 6 moves, hand-counted
# (pushing down first then right takes 8)
SQUARE = ["#####",
          "#___#",
          "#_$_#",
          "#_@.#",
          "#####"]


def env_of(rows, max_turns=20):
    task = TaskSpec("t", "sokoban", 0, difficulty={"max_turns": max_turns}, data={"rows": rows})
    env = make(task)
    return env, env.reset()


def test_render_and_goal_of_a_known_level():
    env, obs = env_of(CORRIDOR)
    assert obs.text == "You are in the room.\n# # # # # # #\n# @ _ $ _ . #\n# # # # # # #\nBoxes on targets: 0 of 1."
    assert obs.admissible == ["right"]  # left, up and down are walls
    assert env.goal.startswith("Push the box onto the target. Legend: # wall, _ floor, @ you, $ box, . target")


def test_corridor_is_solved_in_three_moves_with_reward_one():
    room, player, boxes = parse(tuple(CORRIDOR))
    assert solve(room, player, boxes) == ["right", "right", "right"]
    env, _ = env_of(CORRIDOR)
    r1 = env.step("right")
    assert r1.observation.text.startswith("You move right.") and (r1.reward, r1.done) == (0.0, False)
    r2 = env.step("right")
    assert r2.observation.text.startswith("You push the box right.\n# # # # # # #\n# _ _ @ $ . #")
    r3 = env.step("right")
    assert (r3.reward, r3.done, r3.info["won"], r3.info["lost"]) == (1.0, True, True, False)
    assert "# _ _ _ @ * #" in r3.observation.text and "Boxes on targets: 1 of 1." in r3.observation.text
    assert env.expert_action() is None


def test_optimal_plan_length_is_hand_counted():
    room, player, boxes = parse(tuple(SQUARE))
    plan = solve(room, player, boxes)
    assert plan == ["left", "up", "right", "up", "right", "down"]
    env, _ = env_of(SQUARE)
    actions = []
    while (a := env.expert_action()) is not None:
        actions.append(a)
        res = env.step(a)
    assert actions == plan and res.reward == 1.0 and env.won


def test_box_pushed_against_a_wall_off_target_is_a_loss():
    env, _ = env_of(SQUARE)
    res = env.step("up")  # the box goes to row 1: along the top wall, where no target is
    assert (res.reward, res.done, res.info["won"], res.info["lost"]) == (0.0, True, False, True)
    assert "can never reach a target. You lost." in res.observation.text


def test_two_boxes_frozen_in_a_block_is_a_loss():
    rows = ["#######",
            "#.$___#",
            "#__$_.#",
            "#__@__#",
            "#######"]
    room, _, _ = parse(tuple(rows))
    assert 1 * 7 + 3 not in room.dead  # row 1 has a target: a box there alone could still reach it
    env, _ = env_of(rows)
    res = env.step("up")  # the boxes at (1,2), (1,3) and the wall above form a block: none can move
    assert (res.reward, res.done, res.info["lost"]) == (0.0, True, True)
    rows2 = ["######",
             "#_$__#",
             "#___$#",
             "#_@._#",
             "#__._#",
             "######"]
    room, player, boxes = parse(tuple(rows2))
    assert solve(room, player, boxes) is None  # both boxes sit on dead cells (wall rows off target)


def test_invalid_moves_say_why_and_keep_the_state():
    env, obs = env_of(CORRIDOR)
    res = env.step("left")
    assert res.observation.text == 'Invalid action "left": blocked, a wall is in the way. Valid actions: right.'
    assert res.info["invalid"] and res.observation.anchor == obs.anchor and res.reward == 0.0
    res = env.step("push the box")
    assert res.observation.text == 'Invalid action "push the box": not a move. Valid actions: right.'
    rows = ["#######",
            "#@$$..#",
            "#######"]
    env2, obs2 = env_of(rows)
    assert obs2.admissible == []
    assert "blocked, the box cannot move there" in env2.step("right").observation.text


def test_anchor_depends_on_the_raw_state_only():
    env, start = env_of(SQUARE)
    left = env.step("left").observation
    back = env.step("right").observation
    assert back.anchor == start.anchor and left.anchor != start.anchor


def test_oracle_replans_after_a_deviation():
    env, _ = env_of(SQUARE)
    assert env.expert_action() == "left"
    env.step("right")  # off the plan: the player is at (3,3) on the target
    steps = 1
    while (a := env.expert_action()) is not None:
        env.step(a)
        steps += 1
    # from (3,3), hand-counted: left, left, up (to (2,1)), right (push), up, right, down (push) = 7
    assert env.won and steps == 1 + 7


def test_knobs_are_checked_and_named():
    for bad, name in [({"width": 2}, "width"), ({"n_boxes": 0}, "n_boxes"), ({"min_steps": 1.5}, "min_steps"),
                      ({"max_steps": 2, "min_steps": 3}, "max_steps"), ({"max_turns": 5}, "max_turns"),
                      ({"width": 5, "height": 5, "n_boxes": 3}, "n_boxes")]:
        with pytest.raises(ValueError, match=name):
            resolve("sokoban", "easy", **bad)
    assert resolve("sokoban", "hard", n_boxes=2)["n_boxes"] == 2


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_generated_levels_respect_their_bounds(level):
    knobs = gen.LEVELS[level]
    tasks = generate("sokoban", 6, seed=11, level=level)
    for t in tasks:
        room, player, boxes = parse(tuple(t.data["rows"]))
        assert room.n_boxes == knobs["n_boxes"] and (room.width, room.height) == (knobs["width"], knobs["height"])
        assert knobs["min_steps"] <= t.expert_steps == t.data["optimal_steps"] <= knobs["max_steps"]
    assert gen.candidate(123, dict(knobs)) == gen.candidate(123, dict(knobs))
