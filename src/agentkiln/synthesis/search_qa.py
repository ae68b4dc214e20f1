"""Generator of `search-qa` tasks (agentkiln.envs.search_qa): one seeded knowledge base + question.

A task's data holds the knowledge base's seed and size knobs (the env rebuilds documents and BM25
index from them), `top_k`, and the question and gold answer for reading manifests. A candidate is
kept only if searching each hop's entity name shows that entity's document in the top k: the
oracle's trajectory then really carries the facts it answers from (answering alone always wins).
"""

from __future__ import annotations

import bm25s

from agentkiln.envs.base import TaskSpec
from agentkiln.envs.search_qa import build_kb, words
from agentkiln.synthesis.generate import check_int_knobs

VERSION = f"bm25s-{bm25s.__version__}"
LEVELS: dict[str, dict] = {
    "easy": {"entities": 20, "top_k": 3, "hops": 1, "distractors": 5, "max_turns": 6},
    "medium": {"entities": 60, "top_k": 4, "hops": 2, "distractors": 20, "max_turns": 10},
    "hard": {"entities": 150, "top_k": 5, "hops": 3, "distractors": 60, "max_turns": 15},
}
RANGES = {"entities": (12, 2000), "top_k": (1, 10), "hops": (1, 3), "distractors": (0, 2000), "max_turns": (2, 200)}


def check(knobs: dict) -> None:
    check_int_knobs("search-qa", knobs, RANGES)
    if knobs["max_turns"] < knobs["hops"] + 1:
        raise ValueError(f"search-qa: knob max_turns = {knobs['max_turns']}: must be at least hops + 1 = "
                         f"{knobs['hops'] + 1}")


def candidate(seed: int, knobs: dict, out_dir=None) -> TaskSpec | None:
    size = {k: knobs[k] for k in ("entities", "hops", "distractors")}
    kb = build_kb(seed, **size)
    for name, doc in zip(kb.hop_names, kb.hop_docs):
        if doc not in kb.search(words(name), knobs["top_k"]):
            return None  # an entity's page is crowded out of the top k: retry with another seed
    data = {"kb_seed": seed, **size, "top_k": knobs["top_k"], "question": kb.question, "answer": kb.answer}
    return TaskSpec(task_id=f"search-qa-{seed}", family="search-qa", seed=seed, data=data)
