"""`shop` on a hand-written store (rankings, pages, rewards computed by hand) and on generated ones."""

from __future__ import annotations

import random

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.envs import shop
from agentkiln.envs.shop import ATTR_POOL, BRANDS, CATEGORIES, Goal, Product, Store, build_store, type_match, words
from agentkiln.synthesis import generate
from agentkiln.synthesis.generate import resolve
from agentkiln.synthesis.shop import LEVELS, check

GOAL = Goal("t-shirt", ("cotton", "slim"), (("size", "m"),), 30)
PRODUCTS = (
    Product("p000", "t-shirt", "orbic", ("slim", "cotton", "linen", "relaxed"), (("size", ("s", "m")),), 35.0),
    Product("p001", "t-shirt", "arlo", ("cotton", "slim", "graphic", "organic"), (("size", ("s", "l")),), 18.0),
    Product("p002", "polo shirt", "kentu", ("cotton", "slim", "classic", "pique"), (("size", ("m", "l")),), 20.0),
    Product("p003", "backpack", "zorla", ("canvas", "padded", "waterproof", "vintage"),
            (("colour", ("red", "blue")),), 40.0),
    Product("p004", "t-shirt", "velim", ("striped", "cotton", "slim", "organic"), (("size", ("xs", "m", "l")),), 24.5),
    Product("p005", "t-shirt", "lumio", ("cotton", "linen", "organic", "graphic"), (("size", ("m", "l")),), 12.0),
)
DATA = {"per_page": 2, "queries": ["backpack", "cotton slim t-shirt", "polo shirt"], "oracle_query": "cotton slim t-shirt"}


@pytest.fixture
def env(monkeypatch):
    store = Store(PRODUCTS, 4, GOAL)
    monkeypatch.setattr(shop, "store_of", lambda data: store)
    task = TaskSpec("hand", "shop", 0, difficulty={"max_turns": 20}, data=DATA)
    return make(task)


def test_instruction_type_match_and_reward_formula():
    assert GOAL.instruction == "i need a cotton slim t-shirt with size m, price lower than 30 dollars"
    two = Goal("hoodie", ("warm",), (("size", "l"), ("colour", "red"), ("pack", "pack of 2")), 50)
    assert two.instruction == "i need a warm hoodie with size l, colour red and pack of 2, price lower than 50 dollars"
    assert (type_match("t-shirt", "t-shirt"), type_match("polo shirt", "t-shirt"), type_match("backpack", "t-shirt")) \
        == (1.0, 0.5, 0.0)
    r = GOAL.reward
    assert r(PRODUCTS[4], {"size": "m"}) == 1.0  # everything: (2 + 1 + 1) / 4
    assert r(PRODUCTS[4], {}) == 0.75  # size not chosen
    assert r(PRODUCTS[0], {"size": "m"}) == 0.75  # 35 dollars is not lower than 30
    assert r(PRODUCTS[5], {"size": "m"}) == 0.75  # not slim
    assert r(PRODUCTS[2], {"size": "m"}) == 0.5  # all four hits, but a polo shirt: r_type 0.5
    assert r(PRODUCTS[3], {}) == 0.0  # wrong category


def test_pages_ranking_and_expert_on_a_hand_store(env):
    obs = env.reset()
    assert env.goal == GOAL.instruction
    assert obs.text == "Search page of the shop. Use search[keywords] to find products."
    assert obs.admissible == ["search[backpack]", "search[cotton slim t-shirt]", "search[polo shirt]"]
    # query words cotton slim t shirt: p000 p001 p004 match all 4, p002 p005 three: ranked by score, then id
    res = env.step("search[cotton slim t-shirt]")
    assert res.observation.text == ('Results for "cotton slim t shirt", page 1 of 3: p000 orbic slim cotton t-shirt '
                                    '35.00 dollars; p001 arlo cotton slim t-shirt 18.00 dollars.')
    assert res.observation.admissible == ["back", "click[p000]", "click[p001]", "next"]
    assert env.expert_action() == "next"
    res = env.step("next")
    assert res.observation.admissible == ["back", "click[p002]", "click[p004]", "next", "prev"]
    assert env.expert_action() == "click[p004]"
    res = env.step("click[p004]")
    assert res.observation.text == ("p004 velim striped cotton t-shirt. Price 24.50 dollars. Features: striped, "
                                    "cotton, slim, organic. size: xs, m, l. Selected: none.")
    assert res.observation.admissible == ["back", "buy", "click[l]", "click[m]", "click[xs]"]
    assert env.expert_action() == "click[m]"
    assert env.step("click[m]").observation.text.endswith("Selected: size m.")
    assert env.expert_action() == "buy"
    res = env.step("buy")
    assert res.reward == 1.0 and res.done and res.info["won"] and res.info["bought"] == "p004"
    assert env.turn == 5  # the optimal solution: search, next, click, option, buy


def test_expert_from_elsewhere_and_a_partial_buy(env):
    env.reset()
    env.step("search[backpack]")
    assert env.expert_action() == "back"  # the target is not among these results
    env.step("back")
    env.step("search[cotton slim t-shirt]")
    env.step("next")
    env.step("next")
    assert env.expert_action() == "prev"
    env.step("prev")
    env.step("click[p002]")
    assert env.expert_action() == "back"
    env.step("click[m]")
    res = env.step("buy")
    assert res.done and res.reward == 0.5 and not res.info["won"]
    assert env.step("buy").info["invalid"]  # the episode is over


def test_invalid_actions_free_search_and_title_clicks(env):
    env.reset()
    res = env.step("buy")
    assert res.info["invalid"] and res.observation.text == (
        'Invalid action "buy": on the search page, search[keywords]. Valid actions: search[backpack], '
        "search[cotton slim t-shirt], search[polo shirt].")
    assert env.step("search[☃ !!]").observation.text.startswith(
        'Invalid action "search[☃ !!]": the query has no keywords')
    res = env.step("search[A Padded BACKPACK, please]")  # free-form search: a real search, not listed
    assert not res.info["invalid"]
    assert res.observation.text == 'Results for "padded backpack please", page 1 of 1: p003 zorla canvas padded ' \
                                   "backpack 40.00 dollars."
    assert res.observation.admissible == ["back", "click[p003]"]
    assert env.step("next").info["invalid"]
    res = env.step("click[Zorla  canvas padded backpack]")  # the title works as well as the id
    assert not res.info["invalid"] and res.observation.text.startswith("p003 ")
    res = env.step("click[xl]")
    assert res.info["invalid"] and "click an offered option, buy or back" in res.observation.text
    assert env.step("back").observation.text.startswith('Results for "padded backpack please"')
    assert env.turn == 7


def test_generated_stores_hold_the_target_and_near_misses():
    for level in ("easy", "medium", "hard"):
        k = LEVELS[level]
        args = (k["catalogue"], k["option_dims"], k["required_attrs"], k["required_options"], k["near_misses"])
        for seed in range(5):
            store = build_store(seed, *args)
            assert len(store.products) == k["catalogue"]
            goal, target = store.goal, store.products[store.target]
            assert target.price < goal.bound and set(goal.attrs) <= set(target.attrs)
            assert target.category == goal.category and len(goal.options) == k["required_options"]
            best = dict(goal.options)
            assert goal.reward(target, best) == 1.0
            n = len(goal.attrs) + len(goal.options) + 1
            # a near miss: the right category, the best options it offers, one requirement short
            best_of = [(p, {d: v for d, v in goal.options if v in dict(p.options).get(d, ())}) for p in store.products]
            near = sum(p.category == goal.category and goal.reward(p, sel) == (n - 1) / n for p, sel in best_of)
            assert near >= k["near_misses"]  # random products may add more
    build_store.cache_clear()
    again = build_store(3, *args)
    build_store.cache_clear()
    assert build_store(3, *args) == again


def test_tables_and_knob_checks():
    assert all(len(pool) == ATTR_POOL and all(words(a) == [a] for a in pool) for _, pool in CATEGORIES.values())
    assert all(words(b) == [b] for b in BRANDS)  # index keywords are the words themselves
    with pytest.raises(ValueError, match="required_options = 3: must be at most option_dims = 1"):
        resolve("shop", "easy", required_options=3)
    with pytest.raises(ValueError, match="per_page = 1"):
        resolve("shop", "easy", per_page=1)
    with pytest.raises(ValueError, match="near_misses = 30"):
        resolve("shop", "easy", near_misses=30)
    with pytest.raises(ValueError, match="catalogue = True"):
        check({**LEVELS["easy"], "catalogue": True})


def test_expert_wins_from_random_states():
    rng = random.Random(0)
    for task in generate("shop", 6, seed=11, level="medium"):
        env = make(task)
        obs = env.reset()
        for _ in range(rng.randint(0, 8)):  # wander without buying
            obs = env.step(rng.choice([a for a in obs.admissible if a != "buy"])).observation
        while (a := env.expert_action()) is not None:
            res = env.step(a)
        assert res.info["won"] and res.reward == 1.0
