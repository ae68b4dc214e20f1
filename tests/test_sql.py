"""The `sql` family: the generated database, the locked-down query tool, answers, oracle, generator."""

from __future__ import annotations

import sqlite3

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.envs.sql import ReadOnlyDB, build_db, matches, n_rows, render
from agentkiln.synthesis import generate
from agentkiln.synthesis import sql as gen


def plain(db) -> sqlite3.Connection:
    """An ordinary connection to a copy of the database, to compute answers independently."""
    con = sqlite3.connect(":memory:")
    con.deserialize(db.data)
    return con


def task(query: str, answer, question: str = "Q?", **size) -> TaskSpec:
    size = {"tables": 2, "rows": 10, "columns": 2, **size}
    return TaskSpec("sql-hand", "sql", 3, difficulty={"max_turns": 6},
                    data={"db_seed": 3, **size, "question": question, "query": query, "answer": answer})


def test_database_is_seeded_and_sized_by_the_knobs():
    db = build_db(3, tables=2, rows=10, columns=2)
    assert db.data == build_db.__wrapped__(3, 2, 10, 2).data  # same seed, same bytes
    assert db.data != build_db.__wrapped__(4, 2, 10, 2).data
    assert db.schema == "departments(id, name, city, budget); employees(id, name, department_id, salary, role)"
    con = plain(db)
    assert con.execute("SELECT COUNT(*) FROM departments").fetchone()[0] == 3 == n_rows("departments", 10)
    assert con.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == 10
    assert con.execute("SELECT COUNT(*) FROM employees WHERE department_id NOT IN (SELECT id FROM departments)"
                       ).fetchone()[0] == 0
    assert [n_rows("departments", r) for r in (5, 30, 100, 500)] == [3, 6, 12, 12]
    # hiding columns keeps the rest of the data
    wide = plain(build_db(3, tables=2, rows=10, columns=4))
    assert wide.execute("SELECT name, salary FROM employees").fetchall() == \
        con.execute("SELECT name, salary FROM employees").fetchall()


def test_render_is_compact():
    assert render(["a", "b"], [(1, 2.5), (None, "x")], False) == "2 rows: a | b ; 1 | 2.5 ; NULL | x."
    assert render(["n"], [(3.0,)], False) == "1 row: n ; 3."
    assert render(["n"], [(1,)] * 8, True).startswith("8+ rows: n ; 1 ;")
    assert render(["n"], [(1,)] * 8, True).endswith("(more rows not shown).")
    assert render(["n"], [], False) == "No rows. Columns: n."
    assert render(["t"], [("x" * 50,)], False) == f"1 row: t ; {'x' * 40}...."


def test_answers_are_normalised():
    assert matches("7", 7) and matches(" '7' ", 7) and matches("7.0", 7) and not matches("7.5", 7)
    assert matches("52341.67", 52341.67) and matches("52,341.67", 52341.67) and matches("52341.669", 52341.67)
    assert not matches("52341.6", 52341.67) and not matches("seven", 7)
    assert matches("sales", "Sales") and matches("'Sales'.", "Sales") and matches("  ann   lee ", "Ann Lee")
    assert not matches("SELECT name FROM departments", "Sales")


def test_queries_are_read_only_and_bounded():
    ro = ReadOnlyDB(build_db(3, tables=2, rows=10, columns=2))
    cols, rows, more = ro.query("SELECT COUNT(*) AS n FROM employees")
    assert cols == ["n"] and rows == [(10,)] and not more
    denied = {
        "DELETE FROM employees": "only SELECT queries are allowed",
        "UPDATE employees SET salary = 0": "only SELECT queries are allowed",
        "DROP TABLE employees": "only SELECT queries are allowed",
        "INSERT INTO departments (name) VALUES ('x')": "only SELECT queries are allowed",
        "ATTACH DATABASE '/tmp/agentkiln-sql-escape.db' AS x": "only SELECT queries are allowed",
        "PRAGMA writable_schema = 1": "only SELECT queries are allowed",
        "CREATE TEMP TABLE t (x)": "only SELECT queries are allowed",
        "BEGIN": "only SELECT queries are allowed",
        "SELECT random()": "function random() is not allowed",
        "SELECT date('now')": "function date() is not allowed",
        "SELECT load_extension('/tmp/x')": "function load_extension() is not allowed",
        "SELECT 1; SELECT 2": "You can only execute one statement at a time",
        "SELECT nosuchcolumn FROM employees": "no such column: nosuchcolumn",
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c":
            "query stopped after 2,000,000 steps (too much work)",
        "SELECT zeroblob(1000000000)": "string or blob too big",
    }
    for sql, msg in denied.items():
        with pytest.raises(Exception) as e:
            ro.query(sql)
        assert str(e.value) == msg, sql
    # one step that takes seconds (the step bound cannot see it): the sandbox's CPU/wall limit stops it
    # in another process, four of them in one query included
    big = "length(printf('%.*c', 2000000000, 'x'))"
    for sql in (f"SELECT {big}", f"SELECT {' + '.join([big] * 4)}"):
        with pytest.raises(Exception, match=r"^query stopped: (CPU time limit|timed out)"):
            ro.query(sql)
    with pytest.raises(Exception, match=r"^function fts3_tokenizer\(\) is not allowed$"):  # leaks a pointer
        ro.query("SELECT hex(fts3_tokenizer('simple'))")
    assert ro.query("SELECT x'00ff' AS b")[1] == [(b"\x00\xff",)]  # blobs come back as bytes
    assert ro.query("SELECT COUNT(*) FROM employees")[1] == [(10,)]  # nothing changed
    import os
    assert not os.path.exists("/tmp/agentkiln-sql-escape.db")


def test_episode_with_a_hand_computed_answer():
    db = build_db(3, tables=2, rows=10, columns=2)
    salaries = [s for (s,) in plain(db).execute("SELECT salary FROM employees")]
    expected = sum(s > 70000 for s in salaries)
    query = "SELECT COUNT(*) FROM employees WHERE salary > 70000"
    env = make(task(query, expected, "How many employees have a salary above 70000?"))
    obs = env.reset()
    assert obs.admissible is None and env.goal == "How many employees have a salary above 70000?"
    assert obs.text.startswith("Tables: departments(id, name, city, budget); employees(")
    assert env.expert_action() == f"sql[{query}]"
    res = env.step(env.expert_action())
    assert res.observation.text == f"1 row: COUNT(*) ; {expected}." and not res.done
    assert env.expert_action() == f"answer[{expected}]"
    res = env.step(env.expert_action())
    assert res.done and res.reward == 1.0 and res.info["won"]


def test_wrong_answer_ends_the_episode():
    env = make(task("SELECT COUNT(*) FROM employees", 10))
    env.reset()
    res = env.step("answer[11]")
    assert res.done and res.reward == 0.0 and res.observation.text == "Your answer is wrong."


def test_tool_errors_are_valid_steps_and_garbage_is_invalid():
    env = make(task("SELECT COUNT(*) FROM employees", 10), max_turns=20)
    env.reset()
    res = env.step("sql[DROP TABLE employees]")
    assert res.observation.text == "SQL error: only SELECT queries are allowed."
    assert not res.info["invalid"] and res.info["tool_error"]
    anchor = res.observation.anchor
    for action in ("SELECT 1", "sql[]", "sql[" + "x" * 2000 + "]", "query[SELECT 1]", "answer[]", "sql[SELECT 1"):
        res = env.step(action)
        assert res.info["invalid"] and "sql[query]" in res.observation.text and res.observation.anchor == anchor
    assert env.step("sql[SELECT COUNT(*) FROM employees]").observation.text == "1 row: COUNT(*) ; 10."


def test_oracle_works_from_any_state():
    env = make(task("SELECT COUNT(*) FROM employees", 10), max_turns=20)
    env.reset()
    env.step("sql[SELECT COUNT(*) FROM departments]")  # shows 3, not the gold 10
    assert env.expert_action() == "sql[SELECT COUNT(*) FROM employees]"
    env.step("sql[SELECT 10]")  # any query showing the gold value counts
    assert env.expert_action() == "answer[10]"


def test_environments_have_private_databases():
    a, b = make(task("SELECT 1", 1)), make(task("SELECT 1", 1))
    a.reset()
    b.reset()
    assert a.db is not b.db
    a.close()
    assert b.step("sql[SELECT COUNT(*) FROM employees]").observation.text == "1 row: COUNT(*) ; 10."


def test_check_names_the_bad_knob():
    good = dict(gen.LEVELS["hard"])
    for knob, value in (("tables", 0), ("tables", 6), ("rows", 4), ("columns", 5), ("hops", 3), ("max_turns", 1),
                        ("rows", "many")):
        with pytest.raises(ValueError, match=f"knob {knob} ="):
            gen.check({**good, knob: value})
    with pytest.raises(ValueError, match="knob tables = 2: a question with hops = 2 needs at least 3 tables"):
        gen.check({**good, "tables": 2})


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_generated_gold_answers_hold_on_a_plain_connection(level):
    tasks = generate("sql", 10, seed=11, level=level)
    hops = gen.LEVELS[level]["hops"]
    for t in tasks:
        d = t.data
        con = plain(build_db(d["db_seed"], d["tables"], d["rows"], d["columns"]))
        assert con.execute(d["query"]).fetchall() == [(d["answer"],)]
        assert d["query"].count(" JOIN ") <= hops and d["question"].endswith("?")
        if hops == 2:
            assert " JOIN " in d["query"]
