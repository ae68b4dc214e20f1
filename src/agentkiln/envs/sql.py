"""`sql`: questions about a generated SQLite database, answered with a read-only SQL tool.

A task's database is rebuilt from a seed in its data: up to five tables (departments, employees,
projects, customers, orders, in that order, each child after its parents) with generated rows. Its
question comes from a template with `hops` relation hops and a gold query that returns one value:
0 hops "how many employees have a salary above 52000?", "which customer has the highest credit
limit?"; 1 hop "how many employees work in the department Sales?", "which department has the most
employees?", "how many projects have a budget above the average budget?"; 2 hops "how many orders
were handled by employees who work in the department Sales?", "how many employees work in the
department that runs the project Blue Falcon?".

Actions (free-form, `admissible` is None):
- `sql[query]` runs one SQLite query, read-only, and shows the first rows (at most 8, cells cut to
  40 characters) or the error. A well-formed call whose query fails is a valid step (the error is the
  tool's answer, `info["tool_error"]`).
- `answer[value]` ends the episode. The answer is a value, not a query (a query is compared as text
  and is wrong): the tool and the answer stay separate steps.
Anything else (unknown verb, missing brackets, empty or too long argument) is an invalid step.

Safety of model-written queries: every query runs in the tool sandbox (agentkiln.sandbox: a
separate process with no view of the host, under wall-clock, CPU and memory limits) on its own
in-memory copy of the database (deserialised per query, so nothing is shared or persisted); `PRAGMA query_only`; an
authoriser that allows only SELECT, reads and deterministic functions (no PRAGMA, ATTACH, writes,
transactions, `random()`, clock functions, `fts3_tokenizer()`); a progress handler that aborts a query after a fixed
number of virtual-machine steps (deterministic, unlike a time budget); length, depth and attach
limits; extensions never enabled.

Reward: 1.0 when the answer matches the gold value: numbers numerically (within 0.006 for the
two-decimal averages, exactly otherwise; commas allowed), text after trimming quotes and case.

Knobs: `tables` (1-5) and `rows` (rows per table; departments get rows / 5, at most 12): state size;
`columns` (attribute columns per table, 1-4: the query vocabulary, i.e. action space); `hops`
(relation hops in the question: solution length); `max_turns`.

Oracle: `sql[<gold query>]`, then, once a result showed the gold value, `answer[<gold value>]`.
"""

from __future__ import annotations

import base64
import json
import random
import sqlite3
from dataclasses import dataclass
from functools import lru_cache

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of, tool_call
from agentkiln.sandbox import Limits, Sandbox, default_sandbox

MAX_QUERY_CHARS = 1000
MAX_ANSWER_CHARS = 100
MAX_ROWS = 8
MAX_CELL = 40
MAX_VM_STEPS = 2_000_000  # per query, counted in progress-handler calls of 1,000 steps
VALID = ["sql[query]", "answer[value]"]


@dataclass(frozen=True)
class Table:
    name: str
    singular: str
    label: str  # the column that names a row in answers
    fks: tuple[tuple[str, str, str, str], ...]  # (column, parent table, "work in", inverse "employs")
    attrs: tuple[tuple[str, str, str], ...]  # (column, "int" | "text", phrase), shown in this order


TABLES = (
    Table("departments", "department", "name", (),
          (("city", "text", "city"), ("budget", "int", "budget"), ("floor", "int", "floor"),
           ("founded", "int", "founding year"))),
    Table("employees", "employee", "name", (("department_id", "departments", "work in", "employs"),),
          (("salary", "int", "salary"), ("role", "text", "role"), ("age", "int", "age"),
           ("hired", "int", "hiring year"))),
    Table("projects", "project", "name", (("department_id", "departments", "are run by", "runs"),),
          (("budget", "int", "budget"), ("status", "text", "status"), ("year", "int", "start year"),
           ("priority", "text", "priority"))),
    Table("customers", "customer", "name", (),
          (("city", "text", "city"), ("credit", "int", "credit limit"), ("segment", "text", "segment"),
           ("age", "int", "age"))),
    Table("orders", "order", "id", (("customer_id", "customers", "were placed by", "placed"),
                                    ("employee_id", "employees", "were handled by", "handled")),
          (("amount", "int", "amount"), ("status", "text", "status"), ("year", "int", "year"),
           ("quantity", "int", "quantity"))),
)
FIRST = ("Ann", "Bob", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kim", "Liam", "Mona", "Ned",
         "Olga", "Paul", "Rita", "Sven", "Tara", "Udo", "Vera", "Walt", "Xena", "Yuri", "Zara", "Abe", "Bea", "Cy",
         "Dee", "Eli")
LAST = ("Lee", "Kim", "Diaz", "Berg", "Cole", "Dunn", "Ek", "Fox", "Gray", "Hale", "Ito", "Jung", "Khan", "Lund",
        "Moss", "Nagy", "Ortiz", "Park", "Quinn", "Ross", "Sato", "Toth", "Ueda", "Voss", "Wolf", "Xu", "Young",
        "Zeng", "Abel", "Bose")
DEPARTMENTS = ("Sales", "Research", "Support", "Finance", "Legal", "Marketing", "Design", "Operations",
               "Logistics", "Security", "Training", "Quality")
ADJ = ("Blue", "Red", "Green", "Silent", "Swift", "Bright", "Dark", "Golden", "Iron", "Lucky", "Quiet", "Rapid",
       "Silver", "Bold", "Calm", "Wild", "Young", "Old", "Tiny", "Grand")
NOUN = ("Falcon", "River", "Stone", "Maple", "Comet", "Harbor", "Lantern", "Meadow", "Orbit", "Pine", "Quartz",
        "Raven", "Summit", "Tiger", "Valley", "Willow", "Anchor", "Bridge", "Canyon", "Delta", "Ember", "Forge",
        "Glacier", "Horizon", "Island")
TEXT_VALUES = {
    "city": ("Berlin", "Lisbon", "Oslo", "Prague", "Vienna", "Madrid", "Dublin", "Warsaw"),
    "role": ("engineer", "analyst", "manager", "clerk", "designer"),
    "status": ("active", "paused", "done"),
    "priority": ("low", "medium", "high"),
    "segment": ("retail", "business", "public"),
}
ORDER_STATUS = ("paid", "open", "refunded")
INT_RANGES = {"budget": (10, 500, 1000), "floor": (1, 9, 1), "founded": (1980, 2020, 1), "salary": (60, 240, 500),
              "age": (20, 65, 1), "hired": (2005, 2024, 1), "year": (2015, 2024, 1), "credit": (0, 200, 50),
              "amount": (10, 5000, 1), "quantity": (1, 20, 1)}  # (low, high, scale): value = randint * scale


def n_rows(table: str, rows: int) -> int:
    return min(len(DEPARTMENTS), max(3, rows // 5)) if table == "departments" else rows


@dataclass
class Database:
    tables: tuple[Table, ...]
    columns: int
    data: bytes  # sqlite3 serialisation
    schema: str  # "departments(id, name, city); employees(...)"

    def shown(self, t: Table) -> tuple[tuple[str, str, str], ...]:
        return t.attrs[: self.columns]


@lru_cache(maxsize=256)  # a few tens of kB each at the hard level
def build_db(seed: int, tables: int, rows: int, columns: int) -> Database:
    """The task's database, generated from `seed` (values do not depend on `columns`: hiding columns
    leaves the rest of the data unchanged)."""
    rng = random.Random(seed)
    con = sqlite3.connect(":memory:")
    chosen = TABLES[:tables]
    names = {t.name for t in chosen}
    counts = {t.name: n_rows(t.name, rows) for t in chosen}
    schema = []
    for t in chosen:
        fks = [f for f in t.fks if f[1] in names]
        shown = t.attrs[:columns]
        cols = ["id"] + (["name"] if t.label == "name" else []) + [f[0] for f in fks] + [a[0] for a in shown]
        kinds = {"name": "TEXT", **{f[0]: "INTEGER" for f in fks}, **{a[0]: a[1].upper() for a in shown}}
        decl = ", ".join(["id INTEGER PRIMARY KEY"] + [f"{c} {kinds[c]}" for c in cols[1:]])
        con.execute(f"CREATE TABLE {t.name} ({decl})")
        schema.append(f"{t.name}({', '.join(cols)})")
        n = counts[t.name]
        if t.name == "departments":
            labels = list(rng.sample(DEPARTMENTS, n))
        else:  # distinct two-word names: "Blue Falcon" for projects, "Ann Lee" for people
            first, last = (ADJ, NOUN) if t.name == "projects" else (FIRST, LAST)
            picks = rng.sample(range(len(first) * len(last)), n)
            labels = [f"{first[k // len(last)]} {last[k % len(last)]}" for k in picks]
        for i in range(n):
            row: dict[str, object] = {"id": i + 1}
            if t.label == "name":
                row["name"] = labels[i]
            for col, parent, _, _ in t.fks:
                row[col] = rng.randint(1, counts[parent]) if parent in names else None
            for col, kind, _ in t.attrs:  # every attribute is drawn, shown or not: same data at every `columns`
                if kind == "int":
                    lo, hi, scale = INT_RANGES[col]
                    row[col] = rng.randint(lo, hi) * scale
                else:
                    row[col] = rng.choice(ORDER_STATUS if (t.name, col) == ("orders", "status") else TEXT_VALUES[col])
            con.execute(f"INSERT INTO {t.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                        [row[c] for c in cols])
    con.commit()
    data = con.serialize()
    con.close()
    return Database(chosen, columns, data, "; ".join(schema))


# -- running model-written queries -------------------------------------------------------------------

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"random", "randomblob", "load_extension", "fts3_tokenizer", "readfile", "writefile", "edit", "date", "time", "datetime", "julianday", "strftime",
                     "unixepoch", "timediff", "current_date", "current_time", "current_timestamp", "sqlite_offset"}


_SQLITE_LIMITS = ((sqlite3.SQLITE_LIMIT_LENGTH, 100_000), (sqlite3.SQLITE_LIMIT_SQL_LENGTH, 10_000),
                  (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 100), (sqlite3.SQLITE_LIMIT_ATTACHED, 0),
                  (sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, 20), (sqlite3.SQLITE_LIMIT_FUNCTION_ARG, 16))
# a query that hits one of these is stopped by the sandbox (its steps are bounded, its time is not:
# a single step such as printf('%.*c', 2000000000, 'x') can take seconds)
QUERY_LIMITS = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, output_bytes=65536)
# the sandbox server's SQL configuration (fixed when it starts; a request carries only the database and query)
POLICY = {"limits": {str(k): v for k, v in _SQLITE_LIMITS}, "allowed": sorted(_ALLOWED),
          "denied_functions": sorted(_DENIED_FUNCTIONS), "vm_steps": MAX_VM_STEPS, "max_rows": 64}
_STOPPED = {"timeout", "cpu", "memory", "output"}


class QueryError(Exception):
    pass


class ReadOnlyDB:
    """A task's database for untrusted queries. Each query runs in the tool sandbox (a separate,
    contained process under a wall-clock, CPU and memory limit; see agentkiln.sandbox.run_sql) on a
    private in-memory copy, locked down as the module docstring says: nothing a query does can hold
    or touch the trainer's process."""

    def __init__(self, db: Database, sandbox: Sandbox | None = None, limits: Limits = QUERY_LIMITS):
        self.db_b64 = base64.b64encode(db.data).decode()
        self.sandbox, self.limits = sandbox, limits

    def query(self, sql: str, max_rows: int = MAX_ROWS) -> tuple[list[str], list[tuple], bool]:
        """(column names, first rows, whether there are more) or QueryError with a short message."""
        box = self.sandbox or default_sandbox()
        res = box.run_sql(POLICY, self.db_b64, sql, max_rows, self.limits)
        if not res.ok:
            raise QueryError(f"query stopped: {res.error}" if res.status in _STOPPED else
                             f"cannot run this query ({res.error})")
        out = json.loads(res.stdout)
        if "error" in out:
            if out["denied"]:
                raise QueryError(out["denied"])
            if out["interrupted"]:
                raise QueryError(f"query stopped after {MAX_VM_STEPS:,} steps (too much work)")
            raise QueryError(out["error"])
        rows = [tuple(bytes.fromhex(v["blob"]) if isinstance(v, dict) else v for v in r) for r in out["rows"]]
        return out["cols"], rows, out["more"]

    def close(self) -> None:
        pass


def cell(v: object) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        v = int(v) if v.is_integer() and abs(v) < 1e15 else round(v, 4)
    if isinstance(v, bytes):
        return f"<blob of {len(v)} bytes>"
    text = " ".join(str(v).split())
    return text if len(text) <= MAX_CELL else text[:MAX_CELL] + "..."


def render(cols: list[str], rows: list[tuple], more: bool) -> str:
    if not cols:
        return "The statement returned no result."
    if not rows:
        return f"No rows. Columns: {' | '.join(cols)}."
    lines = [" | ".join(cell(c) for c in cols)] + [" | ".join(cell(v) for v in r) for r in rows]
    head = f"{len(rows)}{'+' if more else ''} row{'s' if len(rows) > 1 or more else ''}"
    tail = " ; (more rows not shown)" if more else ""
    return f"{head}: " + " ; ".join(lines) + tail + "."


# -- answers ------------------------------------------------------------------------------------------

def _number(text: str) -> float | None:
    t = text.strip().strip("'\"`").replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def _text(text: str) -> str:
    return " ".join(text.strip().rstrip(".").strip().strip("'\"`").split()).casefold()


def matches(answer: str, gold: object) -> bool:
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        x = _number(answer)
        if x is None:
            return False
        return abs(x - gold) < 0.006 if isinstance(gold, float) and not gold.is_integer() else x == gold
    return _text(answer) == _text(str(gold))


def db_of(data: dict) -> Database:
    return build_db(data["db_seed"], data["tables"], data["rows"], data["columns"])


class SQLEnv(Env):
    family = "sql"
    free_form = True
    max_reply_tokens = 96
    tools = (("sql", "query", "Run one read-only SQLite query and see its first rows."),
             ("answer", "value", "Give the final answer (a value, not a query)."))

    def _reset(self) -> Observation:
        d = self.task.data
        db = db_of(d)
        if getattr(self, "db", None) is None:  # one private copy per environment, kept across resets
            self.db = ReadOnlyDB(db)
        self.gold = d["answer"]
        self.goal = d["question"]
        self.checked = False  # a result has shown the gold value (the oracle then answers)
        text = (f"Tables: {db.schema}. Question: {d['question']} Use sql[query] to run a SQLite query and "
                "answer[value] to give the answer.")
        return Observation(text, None, anchor_of("sql", self.goal, "start"))

    def _step(self, action: str) -> StepResult:
        call = tool_call(action, ("sql", "answer"))
        if call is None:
            return self.invalid(action, "use sql[query] or answer[value]", VALID)
        tool, arg = call
        if tool == "answer":
            if not arg or len(arg) > MAX_ANSWER_CHARS:
                return self.invalid(action, f"an answer has 1 to {MAX_ANSWER_CHARS} characters", VALID)
            won = matches(arg, self.gold)
            text = "Your answer is correct." if won else "Your answer is wrong."
            obs = Observation(text, None, anchor_of("sql", self.goal, "answered", won))
            return StepResult(obs, float(won), True, {"won": won, "invalid": False})
        if not arg or len(arg) > MAX_QUERY_CHARS:
            return self.invalid(action, f"a query has 1 to {MAX_QUERY_CHARS} characters", VALID)
        try:
            cols, rows, more = self.db.query(arg)
        except QueryError as e:
            text, error = f"SQL error: {e}.", True
        else:
            text, error = render(cols, rows, more), False
            if rows and len(rows[0]) >= 1 and matches(str(rows[0][0]), self.gold):
                self.checked = True
        obs = Observation(text, None, anchor_of("sql", self.goal, text))
        return StepResult(obs, 0.0, False, {"won": False, "invalid": False, "tool_error": error})

    def _expert(self) -> str | None:
        d = self.task.data
        return f"answer[{cell(self.gold)}]" if self.checked else f"sql[{d['query']}]"

    def close(self) -> None:
        if getattr(self, "db", None) is not None:
            self.db.close()
            self.db = None
