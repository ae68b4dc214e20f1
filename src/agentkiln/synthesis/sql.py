"""Generator of `sql` tasks (agentkiln.envs.sql): one seeded database + one templated question.

The database comes from the task's seed (`build_db`, cached). A question template with exactly
`hops` relation hops is drawn (templates that need a table or column the knobs hide are skipped),
its parameters (a threshold, a name, a text value) are drawn from the database itself, and the gold
query runs through the same locked-down connection the agents use. A candidate is kept only if the
gold result is one non-NULL value, a count is not zero and an argmax has no tie (the answer is then
unambiguous); otherwise the shared generate() retries with another seed.

Templates: 0 hops: count above a threshold, count with a text value, an aggregate (total, average
rounded to 2 decimals, highest, lowest; with or without a text filter), argmax/argmin. 1 hop: count
and aggregate of children of a named parent, count of children of parents with a text value, the
parent with the most children, count above the table's average (a nested query). 2 hops: a chain
(orders -> employees -> departments, customers -> orders -> employees) and siblings sharing a
parent (employees in the department that runs a project).
"""

from __future__ import annotations

import random
import sqlite3

from agentkiln.envs.base import TaskSpec
from agentkiln.envs.sql import Database, ReadOnlyDB, Table, build_db
from agentkiln.synthesis.generate import check_int_knobs

VERSION = f"sqlite-{sqlite3.sqlite_version}"
LEVELS: dict[str, dict] = {
    "easy": {"tables": 2, "rows": 10, "columns": 2, "hops": 0, "max_turns": 4},
    "medium": {"tables": 3, "rows": 30, "columns": 3, "hops": 1, "max_turns": 6},
    "hard": {"tables": 5, "rows": 80, "columns": 4, "hops": 2, "max_turns": 8},
}
RANGES = {"tables": (1, 5), "rows": (5, 500), "columns": (1, 4), "hops": (0, 2), "max_turns": (2, 50)}
AGGS = (("total", "SUM({})"), ("average", "ROUND(AVG({}), 2)"), ("highest", "MAX({})"), ("lowest", "MIN({})"))


def check(knobs: dict) -> None:
    check_int_knobs("sql", knobs, RANGES)
    need = {0: 1, 1: 2, 2: 3}[knobs["hops"]]
    if knobs["tables"] < need:
        raise ValueError(f"sql: knob tables = {knobs['tables']}: a question with hops = {knobs['hops']} needs "
                         f"at least {need} tables")


class Q:
    """What templates see: the database, its tables by name and a seeded rng."""

    def __init__(self, db: Database, ro: ReadOnlyDB, rng: random.Random):
        self.db, self.ro, self.rng = db, ro, rng
        self.t = {t.name: t for t in db.tables}

    def attrs(self, t: Table, kind: str) -> list[tuple[str, str, str]]:
        return [a for a in self.db.shown(t) if a[1] == kind]

    def values(self, sql: str) -> list:
        return [r[0] for r in self.ro.query(sql, max_rows=10_000)[1] if r[0] is not None]

    def links(self) -> list[tuple[Table, tuple, Table]]:
        """(child, fk, parent) for every foreign key whose parent is present."""
        return [(c, fk, self.t[fk[1]]) for c in self.db.tables for fk in c.fks if fk[1] in self.t]


def plural(t: Table) -> str:
    return t.name


def who(t: Table) -> str:
    return "who" if t.name in ("employees", "customers") else "that"


def a(phrase: str) -> str:
    return f"an {phrase}" if phrase[0] in "aeiou" else f"a {phrase}"


def _which(t: Table) -> str:
    return f"Which {t.singular}" + (" (give its id)" if t.label == "id" else "")


# -- 0 hops ---------------------------------------------------------------------------------------------

def count_above(q: Q):
    t = q.rng.choice(q.db.tables)
    ints = q.attrs(t, "int")
    if not ints:
        return None
    col, _, phrase = q.rng.choice(ints)
    vals = sorted(set(q.values(f"SELECT {col} FROM {t.name}")))
    if len(vals) < 2:
        return None
    v = q.rng.choice(vals[:-1])
    return f"How many {plural(t)} have {a(phrase)} above {v}?", f"SELECT COUNT(*) FROM {t.name} WHERE {col} > {v}", None


def count_equal(q: Q):
    t = q.rng.choice(q.db.tables)
    texts = q.attrs(t, "text")
    if not texts:
        return None
    col, _, phrase = q.rng.choice(texts)
    val = q.rng.choice(sorted(set(q.values(f"SELECT {col} FROM {t.name}"))))
    return (f"How many {plural(t)} have the {phrase} {val}?",
            f"SELECT COUNT(*) FROM {t.name} WHERE {col} = '{val}'", None)


def aggregate(q: Q):
    t = q.rng.choice(q.db.tables)
    ints, texts = q.attrs(t, "int"), q.attrs(t, "text")
    if not ints:
        return None
    col, _, phrase = q.rng.choice(ints)
    word, fn = q.rng.choice(AGGS)
    if texts and q.rng.random() < 0.5:
        fcol, _, fphrase = q.rng.choice(texts)
        val = q.rng.choice(sorted(set(q.values(f"SELECT {fcol} FROM {t.name}"))))
        return (f"What is the {word} {phrase} of {plural(t)} with the {fphrase} {val}?",
                f"SELECT {fn.format(col)} FROM {t.name} WHERE {fcol} = '{val}'", None)
    return f"What is the {word} {phrase} of all {plural(t)}?", f"SELECT {fn.format(col)} FROM {t.name}", None


def argmax(q: Q):
    t = q.rng.choice(q.db.tables)
    ints = q.attrs(t, "int")
    if not ints:
        return None
    col, _, phrase = q.rng.choice(ints)
    word, order = q.rng.choice((("highest", "DESC"), ("lowest", "ASC")))
    return (f"{_which(t)} has the {word} {phrase}?",
            f"SELECT {t.label} FROM {t.name} ORDER BY {col} {order} LIMIT 1",
            f"SELECT {col} FROM {t.name} ORDER BY {col} {order} LIMIT 2")


# -- 1 hop ----------------------------------------------------------------------------------------------

def _named_parent(q: Q, c: Table, fk: tuple, p: Table) -> str:
    names = q.values(f"SELECT DISTINCT p.name FROM {p.name} p JOIN {c.name} c ON c.{fk[0]} = p.id ORDER BY p.name")
    return q.rng.choice(names) if names else ""


def join_count(q: Q):
    c, fk, p = q.rng.choice(q.links())
    name = _named_parent(q, c, fk, p)
    return (f"How many {plural(c)} {fk[2]} the {p.singular} {name}?",
            f"SELECT COUNT(*) FROM {c.name} c JOIN {p.name} p ON c.{fk[0]} = p.id WHERE p.name = '{name}'", None)


def join_aggregate(q: Q):
    c, fk, p = q.rng.choice(q.links())
    ints = q.attrs(c, "int")
    if not ints:
        return None
    col, _, phrase = q.rng.choice(ints)
    word, fn = q.rng.choice(AGGS)
    name = _named_parent(q, c, fk, p)
    return (f"What is the {word} {phrase} of {plural(c)} that {fk[2]} the {p.singular} {name}?",
            f"SELECT {fn.format('c.' + col)} FROM {c.name} c JOIN {p.name} p ON c.{fk[0]} = p.id "
            f"WHERE p.name = '{name}'", None)


def join_parent_value(q: Q):
    c, fk, p = q.rng.choice(q.links())
    texts = q.attrs(p, "text")
    if not texts:
        return None
    col, _, phrase = q.rng.choice(texts)
    val = q.rng.choice(sorted(set(q.values(f"SELECT {col} FROM {p.name}"))))
    return (f"How many {plural(c)} {fk[2]} {a(p.singular)} with the {phrase} {val}?",
            f"SELECT COUNT(*) FROM {c.name} c JOIN {p.name} p ON c.{fk[0]} = p.id WHERE p.{col} = '{val}'", None)


def most_children(q: Q):
    c, fk, p = q.rng.choice(q.links())
    join = f"FROM {p.name} p JOIN {c.name} c ON c.{fk[0]} = p.id GROUP BY p.id ORDER BY COUNT(*) DESC"
    return (f"Which {p.singular} has the most {plural(c)}?", f"SELECT p.name {join} LIMIT 1",
            f"SELECT COUNT(*) {join} LIMIT 2")


def above_average(q: Q):
    t = q.rng.choice(q.db.tables)
    ints = q.attrs(t, "int")
    if not ints:
        return None
    col, _, phrase = q.rng.choice(ints)
    return (f"How many {plural(t)} have {a(phrase)} above the average {phrase} of all {plural(t)}?",
            f"SELECT COUNT(*) FROM {t.name} WHERE {col} > (SELECT AVG({col}) FROM {t.name})", None)


# -- 2 hops ---------------------------------------------------------------------------------------------

def _chains(q: Q) -> list[tuple[Table, tuple, Table, tuple, Table]]:
    """(child, fk, middle, fk2, parent): child -> middle -> parent."""
    return [(c, fk, m, fk2, p) for c, fk, m in q.links() for mm, fk2, p in q.links() if mm is m]


def chain_count(q: Q):
    chains = _chains(q)
    if not chains:
        return None
    c, fk, m, fk2, p = q.rng.choice(chains)
    names = q.values(f"SELECT DISTINCT p.name FROM {c.name} c JOIN {m.name} m ON c.{fk[0]} = m.id "
                     f"JOIN {p.name} p ON m.{fk2[0]} = p.id ORDER BY p.name")
    if not names:
        return None
    name = q.rng.choice(names)
    return (f"How many {plural(c)} {fk[2]} {plural(m)} {who(m)} {fk2[2]} the {p.singular} {name}?",
            f"SELECT COUNT(*) FROM {c.name} c JOIN {m.name} m ON c.{fk[0]} = m.id JOIN {p.name} p "
            f"ON m.{fk2[0]} = p.id WHERE p.name = '{name}'", None)


def through_child(q: Q):
    """customers -> orders -> employees: parents linked through a child that references both."""
    pairs = [(c, a, b) for c in q.db.tables for a in c.fks for b in c.fks
             if a is not b and a[1] in q.t and b[1] in q.t]
    if not pairs:
        return None
    c, a, b = q.rng.choice(pairs)
    pa, pb = q.t[a[1]], q.t[b[1]]
    names = q.values(f"SELECT DISTINCT pb.name FROM {c.name} c JOIN {pb.name} pb ON c.{b[0]} = pb.id ORDER BY pb.name")
    name = q.rng.choice(names)
    return (f"How many different {plural(pa)} {a[3]} {plural(c)} that {b[2]} the {pb.singular} {name}?",
            f"SELECT COUNT(DISTINCT pa.id) FROM {pa.name} pa JOIN {c.name} c ON c.{a[0]} = pa.id "
            f"JOIN {pb.name} pb ON c.{b[0]} = pb.id WHERE pb.name = '{name}'", None)


def siblings(q: Q):
    """employees in the department that runs a project: two children of one parent."""
    pairs = [(x, fx, y, fy) for x, fx, px in q.links() for y, fy, py in q.links() if px is py and x is not y]
    if not pairs:
        return None
    x, fx, y, fy = q.rng.choice(pairs)
    p = q.t[fx[1]]
    names = q.values(f"SELECT DISTINCT y.name FROM {y.name} y JOIN {x.name} x ON x.{fx[0]} = y.{fy[0]} ORDER BY y.name")
    if not names or y.label != "name":
        return None
    name = q.rng.choice(names)
    ints = q.attrs(x, "int")
    where = f"FROM {x.name} x JOIN {y.name} y ON x.{fx[0]} = y.{fy[0]} WHERE y.name = '{name}'"
    if ints and q.rng.random() < 0.5:
        col, _, phrase = q.rng.choice(ints)
        word, fn = q.rng.choice(AGGS)
        return (f"What is the {word} {phrase} of {plural(x)} {who(x)} {fx[2]} the {p.singular} that {fy[3]} the "
                f"{y.singular} {name}?", f"SELECT {fn.format('x.' + col)} {where}", None)
    return (f"How many {plural(x)} {fx[2]} the {p.singular} that {fy[3]} the {y.singular} {name}?",
            f"SELECT COUNT(*) {where}", None)


TEMPLATES = {0: (count_above, count_equal, aggregate, argmax),
             1: (join_count, join_aggregate, join_parent_value, most_children, above_average),
             2: (chain_count, through_child, siblings)}


def candidate(seed: int, knobs: dict, out_dir=None) -> TaskSpec | None:
    size = {k: knobs[k] for k in ("tables", "rows", "columns")}
    db = build_db(seed, **size)
    ro = ReadOnlyDB(db)
    try:
        rng = random.Random(seed)
        q = Q(db, ro, rng)
        templates = list(TEMPLATES[knobs["hops"]])
        rng.shuffle(templates)
        for template in templates:
            made = template(q) if (knobs["hops"] == 0 or q.links()) else None
            if made is None:
                continue
            question, query, tie_check = made
            _, rows, more = ro.query(query)
            if len(rows) != 1 or more or len(rows[0]) != 1 or rows[0][0] is None or rows[0][0] == 0:
                continue  # not one value, or a count of nothing
            if tie_check is not None:
                top = [r[0] for r in ro.query(tie_check)[1]]
                if len(top) > 1 and top[0] == top[1]:
                    continue  # a tie: two right answers
            answer = rows[0][0]
            data = {"db_seed": seed, **size, "question": question, "query": query, "answer": answer}
            return TaskSpec(task_id=f"sql-{seed}", family="sql", seed=seed, data=data)
        return None
    finally:
        ro.close()
