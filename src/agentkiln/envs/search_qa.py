"""`search-qa`: multi-hop questions over a generated knowledge base, answered with a search tool.

A task's knowledge base is rebuilt from a seed in its data: fictional people, cities, companies and
countries (names made of syllables, hyphen-joined, so no real-world fact can leak in and a
word-level model sees a closed vocabulary), functional relations between them (born_in, works_for,
founded_by, ceo, located_in, in_country, capital), one short document per entity and distractor
documents (news-like sentences that mention the same entities with unrelated facts). A question
follows `hops` relations from a named entity, e.g. "in which city was the founder of Zor-vex Labs
born?", and has a single gold answer.

Actions (free-form, `admissible` is None): `search[query]` shows the top `top_k` documents of a BM25
index (bm25s) over the knowledge base, ties broken by document order; `answer[text]` ends the
episode. Anything else is an invalid step whose observation shows both forms.

Reward: 1.0 when the answer matches the gold answer after SQuAD-style normalisation (lower case,
punctuation and articles dropped, whitespace collapsed; punctuation becomes a space, so
"Ka-zor" = "ka zor"), else 0.0.

Knobs: `entities` (state size), `top_k` (observation size), `distractors` (distractor documents),
`hops` (solution length: hops searches + 1 answer), `max_turns`.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from functools import lru_cache

import bm25s
import numpy as np
from bm25s.tokenization import Tokenized

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of, tool_call

MAX_QUERY_CHARS = 200
MAX_ANSWER_CHARS = 100
VALID = ["search[query]", "answer[text]"]
SYLLABLES = ("ka", "zor", "vel", "mi", "dra", "thu", "len", "or", "sa", "bri", "ko", "nax", "ul", "pe", "rin",
             "ta", "vo", "gar", "shi", "lu", "den", "ba", "ix", "mo", "ter", "fa", "quo", "ne", "ry", "zu",
             "hal", "cor", "ith", "wen", "dal", "je", "pra", "sel", "tov", "yr")
WORDS = tuple(f"{a.capitalize()}-{b}" for a in SYLLABLES for b in SYLLABLES if a != b)  # name words
COMPANY_KINDS = ("Labs", "Systems", "Motors", "Foods", "Media", "Works", "Textiles", "Energy")
STOPWORDS = frozenset("a an the is are was in of and to by at who which what whose where does did".split())
# relation -> (noun phrase for its object, question asking for its object)
RELATIONS: dict[str, tuple[str, str]] = {
    "born_in": ("the birthplace of {}", "in which city was {} born?"),
    "works_for": ("the employer of {}", "which company does {} work for?"),
    "founded_by": ("the founder of {}", "who founded {}?"),
    "ceo": ("the chief executive of {}", "who is the chief executive of {}?"),
    "located_in": ("the home city of {}", "in which city is {} based?"),
    "in_country": ("the country of {}", "in which country is {}?"),
    "capital": ("the capital of {}", "what is the capital of {}?"),
}
DISTRACTORS = (  # (title, text): facts that never answer a question, with the same entities
    ("news", "{person} visited {city} to meet {person2}."),
    ("news", "{company} opened a shop in {city}."),
    ("review", "{person} wrote a book about {company}."),
    ("travel", "{person} moved to {city} after a visit to {country}."),
    ("event", "{city} hosted a fair where {company} showed new products."),
    ("history", "{person2} once worked with {person} at {company}."),
)


def words(text: str) -> list[str]:
    """BM25 tokens: lower-case words without stop words (punctuation, hyphens included, splits)."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS]


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation, punctuation replaced by spaces (names are hyphenated)."""
    text = _PUNCT.sub(" ", text.lower())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


@dataclass(frozen=True)
class Doc:
    title: str
    text: str
    entity: bool = True  # an entity's own page (its title is the entity's name), not a distractor

    @property
    def line(self) -> str:
        return f"{self.title}: {self.text}"


@dataclass
class KB:
    docs: tuple[Doc, ...]
    question: str
    answer: str
    hop_names: tuple[str, ...]  # the entity to look up at each hop
    hop_docs: tuple[int, ...]  # the document of that entity
    retriever: bm25s.BM25 = field(init=False)
    vocab: dict[str, int] = field(init=False)
    _results: dict[tuple, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # an entity's page repeats its title in the index, so a name query finds the page itself first
        tokens = [words(f"{d.title} {d.title} {d.text}" if d.entity else d.line) for d in self.docs]
        self.vocab = {w: i for i, w in enumerate(sorted({w for t in tokens for w in t}))}  # sorted: stable ids
        self.retriever = bm25s.BM25()
        ids = [[self.vocab[w] for w in t] for t in tokens]
        self.retriever.index(Tokenized(ids=ids, vocab=self.vocab), show_progress=False)

    def search(self, query: list[str], k: int) -> tuple[int, ...]:
        """Top-k documents by BM25 score (> 0), ties by document order: deterministic."""
        ids = tuple(dict.fromkeys(self.vocab[w] for w in query if w in self.vocab))
        key = (ids, k)
        if key not in self._results:
            if not ids:
                top: tuple[int, ...] = ()
            else:
                scores = self.retriever.get_scores(list(ids))
                hit = np.flatnonzero(scores > 0)
                top = tuple(int(i) for i in hit[np.lexsort((hit, -scores[hit]))][:k])
            if len(self._results) > 4096:  # free-form queries are unbounded: keep the cache small
                self._results.clear()
            self._results[key] = top
        return self._results[key]


def _names(rng: random.Random, n: int, used: set[str], parts: int) -> list[str]:
    """n new names of `parts` words of two hyphen-joined syllables, never reusing a word."""
    out = []
    while len(out) < n:
        ws = [WORDS[rng.randrange(len(WORDS))] for _ in range(parts)]
        if not any(w in used for w in ws) and len(set(ws)) == parts:
            used.update(ws)
            out.append(" ".join(ws))
    return out


def _chain(rng: random.Random, rel: dict[str, dict[str, str]], hops: int) -> list[tuple[str, str]] | None:
    """A random walk of `hops` relations that never revisits an entity: [(relation, entity)...]."""
    start = rng.choice(sorted(rel))
    path, seen = [("", start)], {start}
    for _ in range(hops):
        here = path[-1][1]
        options = [r for r in sorted(rel[here]) if rel[here][r] not in seen]
        if not options:
            return None
        r = rng.choice(options)
        path.append((r, rel[here][r]))
        seen.add(rel[here][r])
    return path


@lru_cache(maxsize=256)  # about 0.1 MB each at the hard level
def build_kb(seed: int, entities: int, hops: int, distractors: int) -> KB:
    """The knowledge base, question and BM25 index of a task (cached: index building costs)."""
    rng = random.Random(seed)
    n_country = max(2, entities // 10)
    n_city = max(n_country, entities // 4)
    n_company = max(2, entities // 4)
    n_person = max(2, entities - n_country - n_city - n_company)
    used: set[str] = set()
    countries = _names(rng, n_country, used, 1)
    cities = _names(rng, n_city, used, 1)
    companies = [f"{w} {rng.choice(COMPANY_KINDS)}" for w in _names(rng, n_company, used, 1)]
    people = _names(rng, n_person, used, 2)
    kind = {**{c: "country" for c in countries}, **{c: "city" for c in cities},
            **{c: "company" for c in companies}, **{p: "person" for p in people}}
    rel: dict[str, dict[str, str]] = {e: {} for e in (*countries, *cities, *companies, *people)}
    for i, c in enumerate(cities):  # every country gets at least one city, its capital is one of them
        rel[c]["in_country"] = countries[i] if i < n_country else rng.choice(countries)
    for country in countries:
        rel[country]["capital"] = rng.choice([c for c in cities if rel[c]["in_country"] == country])
    for p in people:
        rel[p]["born_in"], rel[p]["works_for"] = rng.choice(cities), rng.choice(companies)
    for co in companies:
        founder, ceo = rng.sample(people, 2)
        rel[co].update(founded_by=founder, ceo=ceo, located_in=rng.choice(cities))

    docs = []
    for p in people:
        docs.append(Doc(p, f"a person born in {rel[p]['born_in']} who works at {rel[p]['works_for']}."))
    for co in companies:
        r = rel[co]
        text = f"a company founded by {r['founded_by']}, run by {r['ceo']} and based in {r['located_in']}."
        docs.append(Doc(co, text))
    for c in cities:
        docs.append(Doc(c, f"a city in {rel[c]['in_country']}."))
    for c in countries:
        docs.append(Doc(c, f"a country whose capital is {rel[c]['capital']}."))
    doc_of = {d.title: i for i, d in enumerate(docs)}

    path = None
    while path is None:
        path = _chain(rng, rel, hops)  # a dead end (country -> capital -> country) draws again
    chain_names = [e for _, e in path]
    question = RELATIONS[path[-1][0]][1]
    np_text = path[0][1]
    for r, _ in path[1:-1]:
        np_text = RELATIONS[r][0].format(np_text)
    question = question.format(np_text)

    # distractors: half of them mention an entity of the question's chain, so they compete in search
    pools = {"person": people, "city": cities, "company": companies, "country": countries}
    for j in range(distractors):
        title, template = rng.choice(DISTRACTORS)
        fill = {k: rng.choice(pools[k]) for k in ("person", "city", "company", "country")}
        if j % 2 == 0:
            e = rng.choice(chain_names[:-1])
            fill[kind[e]] = e
        fill["person2"] = rng.choice([p for p in people if p != fill["person"]])
        docs.append(Doc(title, template.format(**fill), entity=False))
    order = list(range(len(docs)))
    rng.shuffle(order)  # documents in a seeded order: ties and positions carry no hint
    docs = [docs[i] for i in order]
    where = {old: new for new, old in enumerate(order)}
    hop_docs = tuple(where[doc_of[e]] for e in chain_names[:-1])
    return KB(tuple(docs), question, chain_names[-1], tuple(chain_names[:-1]), hop_docs)


def kb_of(data: dict) -> KB:
    return build_kb(data["kb_seed"], data["entities"], data["hops"], data["distractors"])


class SearchQAEnv(Env):
    family = "search-qa"
    free_form = True
    max_reply_tokens = 32
    tools = (("search", "query", "Search the knowledge base and see the top documents."),
             ("answer", "text", "Give the final answer."))

    def _reset(self) -> Observation:
        data = self.task.data
        self.kb = kb_of(data)
        self.top_k = int(data["top_k"])
        self.goal = self.kb.question
        self.seen: set[int] = set()  # documents shown this episode (the oracle skips hops already seen)
        self.query = ""
        text = (f"Answer the question using a knowledge base. search[query] shows the top {self.top_k} "
                "documents; answer[text] gives your final answer.")
        return Observation(text, None, self._anchor())

    def _anchor(self) -> str:
        return anchor_of("search-qa", self.query, sorted(self.seen))

    def _step(self, action: str) -> StepResult:
        call = tool_call(action, ("search", "answer"))
        if call is None:
            return self.invalid(action, "use search[query] or answer[text]", VALID)
        tool, arg = call
        if tool == "answer":
            if not arg or len(arg) > MAX_ANSWER_CHARS:
                return self.invalid(action, f"an answer has 1 to {MAX_ANSWER_CHARS} characters", VALID)
            won = normalize_answer(arg) == normalize_answer(self.kb.answer)
            text = "Your answer is correct." if won else "Your answer is wrong."
            obs = Observation(text, None, anchor_of("search-qa", "answered", won))
            return StepResult(obs, float(won), True, {"won": won, "invalid": False})
        if len(arg) > MAX_QUERY_CHARS:
            return self.invalid(action, f"a query has at most {MAX_QUERY_CHARS} characters", VALID)
        query = words(arg)
        if not query:
            return self.invalid(action, "the query has no searchable words", VALID)
        self.query = " ".join(query)
        top = self.kb.search(query, self.top_k)
        self.seen.update(top)
        if top:
            text = f'Results for "{self.query}": ' + " ".join(
                f"({n}) {self.kb.docs[i].line}" for n, i in enumerate(top, 1))
        else:
            text = f'No documents match "{self.query}".'
        return StepResult(Observation(text, None, self._anchor()), 0.0, False, {"won": False, "invalid": False})

    def _expert(self) -> str | None:
        """Look up each hop's entity whose document was not shown yet, then answer."""
        for name, doc in zip(self.kb.hop_names, self.kb.hop_docs):
            if doc not in self.seen:
                return f"search[{name}]"
        return f"answer[{self.kb.answer}]"
