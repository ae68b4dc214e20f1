"""`shop`: a WebShop-like store with a generated catalogue.

A task's store is rebuilt from a seed in the task's data: products (id, category, brand, four
attribute words, a few option dimensions such as size or colour with the values offered, a price),
with one target that meets the instruction, e.g. "i need a slim cotton t-shirt with size m and
colour red, price lower than 30 dollars", and `near_misses` products of the same category that
miss it by exactly one requirement (an attribute, an option value or the price).

Pages and actions (`admissible` lists the valid ones, sorted):
- search page: `search[<query>]` for a small fixed set of queries (one finds the target, the others
  are partial or distractor queries). Any other `search[<words>]` is also run as a real search
  (free-form agents), but is not listed.
- results page: up to `per_page` products ranked by keyword overlap with the query (ties by id, at
  most MAX_PAGES pages); `click[<id>]` opens one (`click[<title>]` is accepted too), `next`,
  `prev`, `back` (to the search page).
- item page: `click[<option value>]` selects an option, `buy`, `back` (to the results).

Reward on `buy` (the episode ends) is WebShop's attribute match:
    r = r_type * (matched attributes + matched options + [price < bound]) / (attributes + options + 1)
with r_type = 1 for the right category, 0.5 for a category sharing a word with it (polo shirt for
t-shirt), else 0. `won` = (r == 1).

Knobs: `catalogue` products (state size), `per_page` and `option_dims` (action-space size),
`required_attrs` / `required_options` / `near_misses` (solution length: option clicks and pages
to turn), `max_turns`.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of

MAX_PAGES = 5  # results stop after this many pages (WebShop shows at most 50 results)
ATTRS_PER_PRODUCT = 4
MAX_QUERY_CHARS = 200
MAX_QUERY_WORDS = 12

# option dimension -> its values (unique across dimensions, so click[value] is unambiguous)
OPTION_VALUES: dict[str, tuple[str, ...]] = {
    "size": ("xs", "s", "m", "l", "xl"),
    "shoe size": ("us 7", "us 8", "us 9", "us 10", "us 11"),
    "colour": ("black", "white", "red", "blue", "green", "grey", "navy", "brown"),
    "pack": ("pack of 1", "pack of 2", "pack of 3"),
    "width": ("narrow", "regular", "wide"),
    "capacity": ("12 oz", "16 oz", "20 oz"),
    "volume": ("15 litre", "25 litre", "35 litre"),
}
# how a required option reads in the instruction
PHRASE = {"size": "size {}", "shoe size": "size {}", "colour": "colour {}", "pack": "{}", "width": "{} width",
          "capacity": "{}", "volume": "{}"}
GROUP_DIMS = {
    "clothing": ("size", "colour", "pack"),
    "shoes": ("shoe size", "colour", "width"),
    "drinkware": ("capacity", "colour", "pack"),
    "bags": ("colour", "volume", "pack"),
}
# category -> (group, attribute words); several categories share a word, the near-miss types
CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {c: (g, tuple(a.split())) for c, g, a in [
    ("t-shirt", "clothing", "cotton linen organic slim relaxed striped breathable graphic"),
    ("polo shirt", "clothing", "cotton pique slim classic striped breathable stretch embroidered"),
    ("dress shirt", "clothing", "cotton linen slim classic stretch checked formal tailored"),
    ("hoodie", "clothing", "fleece cotton zip oversized warm lightweight pullover organic"),
    ("rain jacket", "clothing", "waterproof lightweight hooded packable windproof breathable insulated reflective"),
    ("denim jacket", "clothing", "denim cotton cropped oversized vintage lined stretch classic"),
    ("yoga pants", "clothing", "stretch breathable cotton seamless flared lightweight organic pocketed"),
    ("running shoes", "shoes", "lightweight breathable cushioned mesh waterproof trail reflective vegan"),
    ("dress shoes", "shoes", "leather classic suede polished formal vegan lightweight handmade"),
    ("hiking boots", "shoes", "waterproof leather insulated lightweight rugged suede breathable vegan"),
    ("rain boots", "shoes", "rubber waterproof tall lined lightweight printed insulated vegan"),
    ("coffee mug", "drinkware", "ceramic glass insulated handmade matte glossy stackable printed"),
    ("travel mug", "drinkware", "steel insulated leakproof ceramic lidded slim matte bamboo"),
    ("water bottle", "drinkware", "steel glass insulated leakproof collapsible slim matte bamboo"),
    ("backpack", "bags", "waterproof canvas leather padded lightweight rolltop vintage recycled"),
    ("laptop bag", "bags", "leather padded canvas slim waterproof vintage recycled lightweight"),
    ("tote bag", "bags", "canvas cotton leather foldable zippered printed recycled organic"),
]}
CATEGORY_NAMES = tuple(CATEGORIES)
CATEGORY_WORDS = {c: tuple(re.findall(r"[a-z0-9]+", c)) for c in CATEGORIES}
ATTR_POOL = 8  # attribute words per category
PICKS = tuple(itertools.permutations(range(ATTR_POOL), ATTRS_PER_PRODUCT))  # every ordered pick of a pool
# dimension -> every subset of its values a product may offer (at least two, canonical order)
SUBSETS = {d: tuple(tuple(v for j, v in enumerate(vals) if m >> j & 1) for m in range(1 << len(vals))
                    if m.bit_count() >= 2) for d, vals in OPTION_VALUES.items()}
BRANDS = ("zorla", "kentu", "mirava", "tobek", "salune", "draxo", "velim", "orbic", "quenta", "lumio",
          "patoro", "nesvik", "arlo", "fennic", "gravo", "hollin", "ismo", "jarvel", "korin", "wenda")
STOPWORDS = frozenset("a an the i need want with in of and for price lower than dollars to".split())


def words(text: str) -> list[str]:
    """Lower-case keyword tokens, without stop words, in order, each once."""
    seen: dict[str, None] = {}
    for w in re.findall(r"[a-z0-9]+", text.lower()):
        if w not in STOPWORDS:
            seen.setdefault(w, None)
    return list(seen)


def type_match(category: str, target: str) -> float:
    """WebShop's r_type: 1 for the right category, 0.5 when the category names share a word."""
    if category == target:
        return 1.0
    return 0.5 if set(re.split(r"[ -]", category)) & set(re.split(r"[ -]", target)) else 0.0


class Product(NamedTuple):
    pid: str
    category: str
    brand: str
    attrs: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (dimension, values offered)
    price: float

    @property
    def title(self) -> str:
        return f"{self.brand} {' '.join(self.attrs[:2])} {self.category}"

    @property
    def line(self) -> str:
        return f"{self.pid} {self.title} {self.price:.2f} dollars"


@dataclass(frozen=True)
class Goal:
    category: str
    attrs: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (dimension, value) required
    bound: int  # price must be lower than this

    @property
    def instruction(self) -> str:
        text = f"i need a {' '.join((*self.attrs, self.category))}"
        opts = [PHRASE[d].format(v) for d, v in self.options]
        if opts:
            text += " with " + (f"{', '.join(opts[:-1])} and {opts[-1]}" if len(opts) > 1 else opts[0])
        return f"{text}, price lower than {self.bound} dollars"

    def reward(self, p: Product, selected: dict[str, str]) -> float:
        hits = sum(a in p.attrs for a in self.attrs) + sum(selected.get(d) == v for d, v in self.options)
        hits += p.price < self.bound
        return type_match(p.category, self.category) * hits / (len(self.attrs) + len(self.options) + 1)


@dataclass
class Store:
    products: tuple[Product, ...]
    target: int  # index of the product the instruction was made from
    goal: Goal
    index: dict[str, list[int]] = field(default_factory=dict)  # keyword -> products (inverted index)
    _results: dict[tuple, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.products):
            for w in dict.fromkeys((p.brand, *p.attrs, *CATEGORY_WORDS[p.category])):  # = words(title + attrs)
                self.index.setdefault(w, []).append(i)

    def search(self, query_words: tuple[str, ...], per_page: int) -> tuple[int, ...]:
        """Products ranked by how many query words they contain, ties by id (= index order)."""
        key = (query_words, per_page)
        if key not in self._results:
            score: dict[int, int] = {}
            for w in query_words:
                for i in self.index.get(w, ()):
                    score[i] = score.get(i, 0) + 1
            ranked = sorted(score, key=lambda i: (-score[i], i))[: per_page * MAX_PAGES]
            if len(self._results) > 4096:  # free-form queries are unbounded: keep the cache small
                self._results.clear()
            self._results[key] = tuple(ranked)
        return self._results[key]


def _offered(rng: random.Random, dim: str, must: str | None = None, never: str | None = None) -> tuple[str, ...]:
    """A random subset (at least two values, canonical order) of a dimension's values."""
    subsets = SUBSETS[dim]
    if must is not None or never is not None:
        subsets = tuple(s for s in subsets if (must is None or must in s) and never not in s)
    return subsets[rng.randrange(len(subsets))]


def _row(rng: random.Random, category: str, option_dims: int, attrs: tuple[str, ...] = (),
         options: dict[str, tuple[str, ...]] | None = None, price: float | None = None) -> tuple:
    """A product without its id; `attrs`, `options` and `price` fix those parts, the rest is random."""
    group, pool = CATEGORIES[category]
    if attrs:  # the target and its near misses: the given attributes, filled up, in a random order
        attrs = [*attrs, *rng.sample([a for a in pool if a not in attrs], ATTRS_PER_PRODUCT - len(attrs))]
        rng.shuffle(attrs)
    else:  # one draw among all ordered picks: the catalogue's bulk is built fast
        attrs = [pool[j] for j in PICKS[rng.randrange(len(PICKS))]]
    options = options or {}
    opts = tuple((d, options.get(d) or _offered(rng, d)) for d in GROUP_DIMS[group][:option_dims])
    brand = BRANDS[rng.randrange(len(BRANDS))]
    return category, brand, tuple(attrs), opts, price if price is not None else round(6 + 89 * rng.random(), 2)


@lru_cache(maxsize=128)  # about 0.6 MB each for 1,000 products
def build_store(seed: int, catalogue: int, option_dims: int, required_attrs: int, required_options: int,
                near_misses: int) -> Store:
    """The store of a task, deterministic from its seed (cached: the env rebuilds it per episode)."""
    rng = random.Random(seed)
    category = rng.choice(CATEGORY_NAMES)
    group, pool = CATEGORIES[category]
    attrs = rng.sample(pool, ATTRS_PER_PRODUCT)
    dims = GROUP_DIMS[group][:option_dims]
    offered = {d: _offered(rng, d) for d in dims}
    req_dims = rng.sample(dims, required_options)
    req_opts = tuple((d, rng.choice(offered[d])) for d in dims if d in req_dims)
    price = round(6 + 89 * rng.random(), 2)
    goal = Goal(category, tuple(attrs[:required_attrs]), req_opts, int(price // 10 + 1) * 10)
    rows = [_row(rng, category, option_dims, tuple(attrs), offered, price)]
    # near misses: the target's category and requirements, with exactly one of them broken
    ways = ["attr"] * bool(goal.attrs) + ["option"] * bool(goal.options) + ["price"]
    others = [a for a in pool if a not in goal.attrs]
    for _ in range(near_misses):
        way = rng.choice(ways)
        keep, opts = list(goal.attrs), {d: _offered(rng, d, must=v) for d, v in goal.options}
        cost = round(rng.uniform(goal.bound / 2, goal.bound - 0.01), 2)  # within budget unless it is the miss
        if way == "attr":
            keep.pop(rng.randrange(len(keep)))  # filled up without any required attribute
            keep += rng.sample(others, ATTRS_PER_PRODUCT - len(keep))
        elif way == "option":
            d, v = rng.choice(goal.options)
            opts[d] = _offered(rng, d, never=v)
        else:
            cost = round(rng.uniform(goal.bound, goal.bound + 20), 2)
        rows.append(_row(rng, category, option_dims, tuple(keep), opts, cost))
    while len(rows) < catalogue:
        rows.append(_row(rng, CATEGORY_NAMES[rng.randrange(len(CATEGORY_NAMES))], option_dims))
    order = list(range(len(rows)))
    rng.shuffle(order)  # ids carry no hint of which product is the target
    width = max(3, len(str(catalogue - 1)))
    products = tuple(Product(f"p{pos:0{width}d}", *rows[i]) for pos, i in enumerate(order))
    return Store(products, order.index(0), goal)


def store_of(data: dict) -> Store:
    return build_store(data["store_seed"], data["catalogue"], data["option_dims"], data["required_attrs"],
                       data["required_options"], data["near_misses"])


class ShopEnv(Env):
    family = "shop"

    # -- state: page in {"search", "results", "item"}, query words, results, page number, item, options
    def _reset(self) -> Observation:
        data = self.task.data
        self.store = store_of(data)
        self.per_page = int(data["per_page"])
        self.queries = list(data["queries"])
        self.oracle_query = data["oracle_query"]
        self.goal = self.store.goal.instruction
        self.page, self.query, self.results, self.page_no = "search", (), (), 0
        self.item, self.selected = -1, {}
        return self._observe()

    # -- views ---------------------------------------------------------------------------------
    def _shown(self) -> tuple[int, ...]:
        return self.results[self.page_no * self.per_page:(self.page_no + 1) * self.per_page]

    def _pages(self) -> int:
        return max(1, -(-len(self.results) // self.per_page))

    def _admissible(self) -> list[str]:
        if self.page == "search":
            return sorted(f"search[{q}]" for q in self.queries)
        if self.page == "results":
            acts = [f"click[{self.store.products[i].pid}]" for i in self._shown()] + ["back"]
            acts += ["next"] * (self.page_no + 1 < self._pages()) + ["prev"] * (self.page_no > 0)
            return sorted(acts)
        p = self.store.products[self.item]
        return sorted([f"click[{v}]" for _, vals in p.options for v in vals] + ["back", "buy"])

    def _text(self) -> str:
        if self.page == "search":
            return "Search page of the shop. Use search[keywords] to find products."
        q = " ".join(self.query)
        if self.page == "results":
            if not self.results:
                return f'No products match "{q}". Use back to search again.'
            lines = "; ".join(self.store.products[i].line for i in self._shown())
            return f'Results for "{q}", page {self.page_no + 1} of {self._pages()}: {lines}.'
        p = self.store.products[self.item]
        opts = " ".join(f"{d}: {', '.join(vals)}." for d, vals in p.options)
        chosen = ", ".join(PHRASE[d].format(self.selected[d]) for d, _ in p.options if d in self.selected)
        return (f"{p.pid} {p.title}. Price {p.price:.2f} dollars. Features: {', '.join(p.attrs)}. {opts} "
                f"Selected: {chosen or 'none'}.")

    def _observe(self) -> Observation:
        anchor = anchor_of("shop", self.page, self.query, self.page_no, self.item,
                           sorted(self.selected.items()))
        return Observation(self._text(), self._admissible(), anchor)

    def _ok(self) -> StepResult:
        return StepResult(self._observe(), 0.0, False, {"won": False, "invalid": False})

    # -- transitions -----------------------------------------------------------------------------
    def _search(self, action: str) -> StepResult:
        m = re.fullmatch(r"search\[(.*)\]", action, re.S)
        if m is None:
            return self.invalid(action, "on the search page, search[keywords]")
        if len(m.group(1)) > MAX_QUERY_CHARS:
            return self.invalid(action, f"a query has at most {MAX_QUERY_CHARS} characters")
        query = tuple(words(m.group(1))[:MAX_QUERY_WORDS])
        if not query:
            return self.invalid(action, "the query has no keywords (letters or digits)")
        self.page, self.query, self.page_no = "results", query, 0
        self.results = self.store.search(query, self.per_page)
        return self._ok()

    def _step(self, action: str) -> StepResult:
        if self.page == "search":
            return self._search(action)
        if self.page == "results":
            shown = self._shown()
            if action == "back":
                self.page, self.query, self.results, self.page_no = "search", (), (), 0
            elif action == "next" and self.page_no + 1 < self._pages():
                self.page_no += 1
            elif action == "prev" and self.page_no > 0:
                self.page_no -= 1
            elif (i := self._clicked(action, shown)) >= 0:
                self.page, self.item, self.selected = "item", i, {}
            else:
                return self.invalid(action, "on a results page, click a shown product, next, prev or back")
            return self._ok()
        product = self.store.products[self.item]
        if action == "back":
            self.page, self.item, self.selected = "results", -1, {}
            return self._ok()
        if action == "buy":
            reward = self.store.goal.reward(product, self.selected)
            text = f"You bought {product.title}. Thank you for shopping. Score {reward:.2f}."
            obs = Observation(text, [], anchor_of("shop", "bought", self.item, sorted(self.selected.items())))
            return StepResult(obs, reward, True, {"won": reward == 1.0, "invalid": False, "bought": product.pid})
        m = re.fullmatch(r"click\[(.*)\]", action, re.S)
        for dim, values in product.options:
            if m and m.group(1) in values:
                self.selected[dim] = m.group(1)
                return self._ok()
        return self.invalid(action, "on an item page, click an offered option, buy or back")

    def _clicked(self, action: str, shown: tuple[int, ...]) -> int:
        """The shown product `click[<id or title>]` names (case and spacing ignored); -1 if none."""
        m = re.fullmatch(r"click\[(.*)\]", action, re.S)
        key = " ".join(m.group(1).lower().split()) if m else None
        for i in shown:
            p = self.store.products[i]
            if key in (p.pid, p.title):
                return i
        return -1

    # -- the oracle ------------------------------------------------------------------------------
    def _expert(self) -> str | None:
        target = self.store.target
        if self.page == "search":
            return f"search[{self.oracle_query}]"
        if self.page == "results":
            if target not in self.results:
                return "back"
            want = self.results.index(target) // self.per_page
            if want == self.page_no:
                return f"click[{self.store.products[target].pid}]"
            return "next" if want > self.page_no else "prev"
        if self.item != target:
            return "back"
        for dim, value in self.store.goal.options:
            if self.selected.get(dim) != value:
                return f"click[{value}]"
        return "buy"
