"""`search-qa` on a hand-written knowledge base (rankings and episodes known by hand) and on generated ones."""

from __future__ import annotations

import random

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.envs import search_qa
from agentkiln.envs.search_qa import KB, STOPWORDS, SYLLABLES, Doc, build_kb, normalize_answer, words
from agentkiln.synthesis import generate
from agentkiln.synthesis.generate import resolve
from agentkiln.synthesis.search_qa import LEVELS

DOCS = (
    Doc("Zor-vex Labs", "a company founded by Vel-or San-ta, run by Mi-ka Dra-thu and based in Len-ba."),
    Doc("Vel-or San-ta", "a person born in Kar-tho who works at Zor-vex Labs."),
    Doc("Kar-tho", "a city in Os-tre."),
    Doc("news", "Vel-or San-ta visited Len-ba to meet Mi-ka Dra-thu.", entity=False),
    Doc("Len-ba", "a city in Os-tre."),
    Doc("Os-tre", "a country whose capital is Kar-tho."),
)
QUESTION = "in which city was the founder of Zor-vex Labs born?"


def hand_env(monkeypatch, top_k):
    kb = KB(DOCS, QUESTION, "Kar-tho", ("Zor-vex Labs", "Vel-or San-ta"), (0, 1))
    monkeypatch.setattr(search_qa, "kb_of", lambda data: kb)
    return make(TaskSpec("hand", "search-qa", 0, difficulty={"max_turns": 10}, data={"top_k": top_k}))


def test_answer_normalisation():
    assert normalize_answer("  The Kar-tho! ") == "kar tho"
    assert normalize_answer("KAR  tho.") == normalize_answer("kar-tho") == "kar tho"
    assert normalize_answer("an Os-tre, a") == "os tre"
    assert normalize_answer("Kartho") != normalize_answer("Kar-tho")


def test_bm25_ranking_and_ties_on_a_hand_kb():
    kb = KB(DOCS, QUESTION, "Kar-tho", ("Zor-vex Labs", "Vel-or San-ta"), (0, 1))
    # the country's page holds "os tre" twice (its title counts twice), the two cities once each with
    # the same length: a tie, broken by document order
    assert kb.search(words("Os-tre"), 3) == (5, 2, 4)
    assert kb.search(words("zor vex labs"), 2) == (0, 1)  # the company's own page first
    assert kb.search(words("Vel-or San-ta"), 1) == (1,)
    assert kb.search(words("unknown words"), 3) == ()
    assert kb.search(words("the of a"), 3) == ()  # only stop words


def test_hand_episode_with_every_hop(monkeypatch):
    env = hand_env(monkeypatch, top_k=1)
    obs = env.reset()
    assert env.goal == QUESTION and obs.admissible is None and env.free_form
    assert obs.text == ("Answer the question using a knowledge base. search[query] shows the top 1 documents; "
                        "answer[text] gives your final answer.")
    assert env.expert_action() == "search[Zor-vex Labs]"
    res = env.step("search[Zor-vex Labs]")
    assert res.observation.text == ('Results for "zor vex labs": (1) Zor-vex Labs: a company founded by Vel-or '
                                    "San-ta, run by Mi-ka Dra-thu and based in Len-ba.")
    assert env.expert_action() == "search[Vel-or San-ta]"
    res = env.step("search[Vel-or San-ta]")
    assert res.observation.text == ('Results for "vel or san ta": (1) Vel-or San-ta: a person born in Kar-tho who '
                                    "works at Zor-vex Labs.")
    assert env.expert_action() == "answer[Kar-tho]"
    res = env.step("answer[ the KAR tho. ]")
    assert res.reward == 1.0 and res.done and res.info["won"] and env.turn == 3


def test_expert_skips_hops_already_seen(monkeypatch):
    env = hand_env(monkeypatch, top_k=2)
    env.reset()
    env.step("search[Zor-vex Labs]")  # the top 2 hold both the company's and the founder's page
    assert env.expert_action() == "answer[Kar-tho]"
    env = hand_env(monkeypatch, top_k=1)
    env.reset()
    env.step("search[Vel-or San-ta]")  # the second hop first: the oracle still needs the first
    assert env.expert_action() == "search[Zor-vex Labs]"
    env.step("search[Zor-vex Labs]")
    assert env.expert_action() == "answer[Kar-tho]"


def test_invalid_actions_and_a_wrong_answer(monkeypatch):
    env = hand_env(monkeypatch, top_k=2)
    env.reset()
    res = env.step("look around")
    assert res.info["invalid"] and not res.done
    assert res.observation.text == ('Invalid action "look around": use search[query] or answer[text]. '
                                    "Valid actions: search[query], answer[text].")
    assert "no searchable words" in env.step("search[ ☃ ]").observation.text
    assert "an answer has 1 to 100 characters" in env.step("answer[]").observation.text
    assert "at most 200 characters" in env.step("search[" + "x" * 300 + "]").observation.text
    res = env.step(" SEARCH [ nothing here ] ")  # spacing and case of the tool name are forgiven
    assert not res.info["invalid"] and res.observation.text == 'No documents match "nothing here".'
    res = env.step("answer[Len-ba]")
    assert res.done and res.reward == 0.0 and not res.info["won"] and not res.info["invalid"]
    assert res.observation.text == "Your answer is wrong."


def test_generated_questions_follow_their_chain():
    assert not STOPWORDS & set(SYLLABLES)  # every part of a name is searchable
    for level in ("easy", "medium", "hard"):
        k = LEVELS[level]
        for seed in range(8):
            kb = build_kb(seed, k["entities"], k["hops"], k["distractors"])
            assert len(kb.hop_names) == k["hops"] and kb.hop_names[0] in kb.question
            titles = [d.title for d in kb.docs if d.entity]
            assert len(titles) == len(set(titles))  # names are unique
            links = (*kb.hop_names[1:], kb.answer)
            for name, doc, nxt in zip(kb.hop_names, kb.hop_docs, links):
                assert kb.docs[doc].title == name and nxt in kb.docs[doc].text  # each hop's page names the next
            assert kb.answer not in kb.hop_names
            assert sum(not d.entity for d in kb.docs) == k["distractors"]
    args = (3, 150, 3, 60)
    first = build_kb(*args)
    build_kb.cache_clear()
    again = build_kb(*args)
    assert again.docs == first.docs and again.question == first.question
    for name in ("Labs", first.answer, "city in", first.hop_names[0]):
        assert again.search(words(name), 5) == first.search(words(name), 5)


def test_knob_checks():
    with pytest.raises(ValueError, match="hops = 4"):
        resolve("search-qa", "easy", hops=4)
    with pytest.raises(ValueError, match="max_turns = 3: must be at least hops"):
        resolve("search-qa", "hard", max_turns=3)
    with pytest.raises(ValueError, match="top_k = 0"):
        resolve("search-qa", "easy", top_k=0)


def test_expert_wins_after_random_searches():
    rng = random.Random(0)
    for task in generate("search-qa", 6, seed=5, level="hard"):
        env = make(task)
        env.reset()
        for _ in range(rng.randint(0, 4)):
            env.step(f"search[{rng.choice(env.kb.docs).title}]")
        while (a := env.expert_action()) is not None:
            res = env.step(a)
        assert res.info["won"] and res.reward == 1.0
        assert task.expert_steps <= task.difficulty["hops"] + 1
