"""Generator of `shop` tasks (agentkiln.envs.shop): one seeded store and instruction per task.

A task's data holds the store's seed and size knobs (the env rebuilds the catalogue from them), the
results page size, the search queries offered on the search page and the oracle's query. The
offered queries are the instruction's keywords (finds the target), the category alone, one
attribute + category, and distractor queries for other (preferably similar) categories.
"""

from __future__ import annotations

import random

from agentkiln.envs.base import TaskSpec
from agentkiln.envs.shop import CATEGORIES, CATEGORY_NAMES, MAX_PAGES, build_store, type_match, words
from agentkiln.synthesis.generate import check_int_knobs

VERSION = ""
LEVELS: dict[str, dict] = {
    "easy": {"catalogue": 40, "per_page": 3, "option_dims": 1, "required_attrs": 1, "required_options": 1,
             "near_misses": 2, "max_turns": 15},
    "medium": {"catalogue": 200, "per_page": 5, "option_dims": 2, "required_attrs": 2, "required_options": 2,
               "near_misses": 6, "max_turns": 20},
    "hard": {"catalogue": 1000, "per_page": 8, "option_dims": 3, "required_attrs": 3, "required_options": 3,
             "near_misses": 15, "max_turns": 30},
}
RANGES = {"catalogue": (20, 5000), "per_page": (2, 10), "option_dims": (1, 3), "required_attrs": (0, 3),
          "required_options": (0, 3), "near_misses": (0, 40), "max_turns": (5, 200)}
N_DISTRACTOR_QUERIES = 3


def check(knobs: dict) -> None:
    check_int_knobs("shop", knobs, RANGES)
    if knobs["required_options"] > knobs["option_dims"]:
        raise ValueError(f"shop: knob required_options = {knobs['required_options']}: must be at most "
                         f"option_dims = {knobs['option_dims']}")
    cap = knobs["per_page"] * (MAX_PAGES - 1)  # room for the target among its near misses
    if knobs["near_misses"] > cap:
        raise ValueError(f"shop: knob near_misses = {knobs['near_misses']}: must be at most "
                         f"per_page * {MAX_PAGES - 1} = {cap}")
    if knobs["near_misses"] + 1 > knobs["catalogue"]:
        raise ValueError(f"shop: knob catalogue = {knobs['catalogue']}: must exceed near_misses")


def queries(rng: random.Random, category: str, attrs: tuple[str, ...]) -> tuple[str, list[str]]:
    """The oracle's query and the offered ones (the oracle's included)."""
    best = " ".join((*attrs, category))
    offered = {best, category}
    if len(attrs) >= 2:
        offered.add(f"{rng.choice(attrs)} {category}")
    similar = [c for c in CATEGORY_NAMES if c != category and type_match(c, category) > 0]
    others = [c for c in CATEGORY_NAMES if c != category and c not in similar]
    picks = rng.sample(similar, min(len(similar), 2))
    picks += rng.sample(others, N_DISTRACTOR_QUERIES - len(picks))
    for c in picks:
        pool = CATEGORIES[c][1]
        offered.add(" ".join((*rng.sample(pool, rng.randint(1, 2)), c)))
    return best, sorted(offered)


def candidate(seed: int, knobs: dict, out_dir=None) -> TaskSpec | None:
    size = {k: knobs[k] for k in ("catalogue", "option_dims", "required_attrs", "required_options", "near_misses")}
    store = build_store(seed, **size)
    rng = random.Random(f"shop-queries-{seed}")
    best, offered = queries(rng, store.goal.category, store.goal.attrs)
    if store.target not in store.search(tuple(words(best)), knobs["per_page"]):
        return None  # the target fell past the last results page: retry with another seed
    data = {"store_seed": seed, **size, "per_page": knobs["per_page"], "oracle_query": best, "queries": offered,
            "instruction": store.goal.instruction}
    return TaskSpec(task_id=f"shop-{seed}", family="shop", seed=seed, data=data)
