"""The `python-tool` family: answer checking, the tool's observations, the oracle, the generator."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.envs.python_tool import eval_countdown, numbers_in
from agentkiln.synthesis import python_tool as gen

COUNTDOWN = TaskSpec("pt-countdown", "python-tool", 0, difficulty={"max_turns": 6},
                     data={"kind": "countdown", "question": "Using the numbers 3 7 25 50, each at most once, with "
                           "+ - * / and parentheses, make 175.", "numbers": [3, 7, 25, 50], "ops": "+-*/",
                           "target": 175, "solution": "(50 + 25) * 7 / 3"})
ARITHMETIC = TaskSpec("pt-arith", "python-tool", 1, difficulty={"max_turns": 6},
                      data={"kind": "arithmetic", "question": "Mia has 10 shells. Tom has 4 cards. Mia gets 5 more "
                            "shells. Each of Mia's shells is then traded for 3 new ones. How many shells does Mia "
                            "have now?", "answer": 45, "solution": "(10 + 5) * 3"})


def test_countdown_expressions_are_checked_by_walking_the_ast():
    nums, ops = [3, 7, 25, 50], "+-*/"
    assert eval_countdown("(50 + 25) * 7 / 3", nums, ops) == (Fraction(175), "")
    assert eval_countdown("(50 + 25) * 7 / 3 = 175", nums, ops) == (Fraction(175), "")
    assert eval_countdown("7 * 7", nums, ops) == (None, "7 is not an available number")
    assert eval_countdown("8 + 3", nums, ops) == (None, "8 is not an available number")
    assert eval_countdown("50 ** 3", nums, ops)[1] == "only the numbers, + - * / and parentheses are allowed"
    assert eval_countdown("-3 + 50", nums, ops)[0] is None
    assert eval_countdown("50 * 3", nums, "+-")[1] == "only the numbers, + - and parentheses are allowed"
    assert eval_countdown("25 / (3 - 3)", [3, 3, 25], ops) == (None, "it divides by zero")
    assert eval_countdown("__import__('os').system('ls')", nums, ops)[0] is None
    assert eval_countdown("((((" * 300 + "3" + "))))" * 300, nums, ops)[0] is None
    assert eval_countdown("hello", nums, ops) == (None, "only the numbers, + - * / and parentheses are allowed")
    assert eval_countdown("3 +", nums, ops) == (None, "it is not an arithmetic expression")


def test_numbers_in_text():
    assert numbers_in("1,234.5 apples, then 3 and -2 and .5") == [1234.5, 3.0, -2.0, 0.5]
    assert numbers_in("[1,2]") == [1.0, 2.0]


def test_countdown_episode_through_the_oracle():
    env = make(COUNTDOWN)
    obs = env.reset()
    assert obs.admissible is None and env.goal == COUNTDOWN.data["question"]
    assert obs.text.startswith("Using the numbers 3 7 25 50") and "python[code]" in obs.text
    assert env.expert_action() == "python[print((50 + 25) * 7 / 3)]"
    res = env.step(env.expert_action())
    assert res.observation.text == "Output: 175.0" and not res.done and res.reward == 0.0
    assert res.info["invalid"] is False and res.info["tool_error"] is False
    assert env.expert_action() == "answer[(50 + 25) * 7 / 3]"
    res = env.step(env.expert_action())
    assert res.done and res.reward == 1.0 and res.info["won"]
    assert res.observation.text == "Your answer is correct."


def test_wrong_answers_end_the_episode_and_say_why():
    env = make(COUNTDOWN)
    env.reset()
    res = env.step("answer[50 + 25]")
    assert res.done and res.reward == 0.0 and not res.info["won"]
    assert res.observation.text == "Your answer is wrong: it makes 75, not 175."
    env.reset()
    assert env.step("answer[175]").observation.text == "Your answer is wrong: 175 is not an available number."


def test_arithmetic_answers_are_compared_numerically():
    env = make(ARITHMETIC)
    for answer, won in (("45", True), ("45 shells", True), ("45.0", True), ("44", False), ("45 or 46", False)):
        env.reset()
        res = env.step(f"answer[{answer}]")
        assert res.done and res.reward == float(won), answer
    env.reset()
    assert env.step("answer[45 or 46]").observation.text == "Your answer is wrong: give exactly one number."


def test_tool_errors_are_valid_steps_with_the_error_shown():
    env = make(ARITHMETIC, max_turns=10)
    env.reset()
    res = env.step("python[print(1 / 0)]")
    assert res.observation.text == "Error: ZeroDivisionError: division by zero."
    assert res.info["invalid"] is False and res.info["tool_error"] is True and res.info["tool_status"] == "error"
    res = env.step("python[import socket; socket.create_connection(('1.1.1.1', 80))]")
    assert res.observation.text == "Error: network is disabled in the sandbox."
    res = env.step("python[x = 45]")
    assert res.observation.text == "Output: (nothing printed, use print)"
    res = env.step("python[while True: pass]")
    assert res.observation.text == "Error: time limit exceeded."
    res = env.step("python[print('y' * 5000)]")
    text = res.observation.text
    assert text.startswith("Error: output too long. Output: yyyy") and text.endswith("...")


def test_invalid_actions_cost_a_turn_and_show_the_syntax():
    env = make(ARITHMETIC)
    obs = env.reset()
    for action in ("run[print(1)]", "python[]", "answer[]", "python print(1)", "answer[" + "9" * 300 + "]"):
        res = env.step(action)
        assert res.info["invalid"] and not res.done and res.reward == 0.0
        assert "python[code]" in res.observation.text and res.observation.anchor == obs.anchor
    assert env.turn == 5


def test_oracle_works_from_any_state():
    env = make(ARITHMETIC, max_turns=10)
    env.reset()
    env.step("python[print(44)]")  # a wrong value does not count as checked
    assert env.expert_action() == "python[print((10 + 5) * 3)]"
    env.step("garbage")
    env.step(env.expert_action())
    assert env.expert_action() == "answer[45]"
    assert env.step(env.expert_action()).reward == 1.0


def test_check_names_the_bad_knob():
    good = dict(gen.LEVELS["medium"])
    for knob, value in (("numbers", 1), ("magnitude", 5), ("ops", "+x"), ("ops", ""), ("ops", "++"),
                        ("kind", "algebra"), ("steps", 0), ("max_turns", 1), ("numbers", True), ("oracle", "prose")):
        with pytest.raises(ValueError, match=f"knob {knob} ="):
            gen.check({**good, knob: value})
    with pytest.raises(ValueError, match="knob steps = 4: must be at most numbers - 1 = 3"):
        gen.check({**good, "numbers": 4, "steps": 4})


@pytest.mark.parametrize("seed", range(20))
def test_generated_problems_are_sound(seed):
    knobs = {"kind": "mixed", "numbers": 6, "magnitude": 100, "ops": "/*-+", "steps": 4, "max_turns": 8}
    task = gen.candidate(seed, knobs)
    if task is None:
        return
    assert task == gen.candidate(seed, knobs)  # deterministic
    d = task.data
    if d["kind"] == "countdown":
        assert d["ops"] == "+-*/" and len(d["numbers"]) == 6 and d["target"] not in d["numbers"]
        assert eval_countdown(d["solution"], d["numbers"], d["ops"]) == (Fraction(d["target"]), "")
    else:
        assert eval(d["solution"], {"__builtins__": {}}) == d["answer"]  # our own generated expression
        assert len(numbers_in(d["question"])) == 6 and d["question"].endswith("have now?")


def test_countdown_generation_by_hand():
    # steps = 1 with "+" only: the target is the sum of two of the drawn numbers
    rng = random.Random(5)
    d = gen.countdown(rng, numbers=3, magnitude=20, ops="+", steps=1)
    a, b = (int(x) for x in d["solution"].split(" + "))
    assert d["target"] == a + b and a >= b and {a, b} <= set(d["numbers"])


# the in-process arithmetic fast path must print exactly what the sandbox prints, and decline the rest
from agentkiln.envs.python_fastpath import run_in_process  # noqa: E402

SAME_OUTPUT = [
    "print((50 + 25) * 7 / 3)", "print(175)", "x = 12 * 4\nprint(x - 5)", "x = 7; x *= 3; x -= 1; print(x, x / 4)",
    "print(2 ** 100)", "print(2 ** -3, 7 // 2, -7 // 2, 7 % -3, -2.5 % 2)", "print(10 / 3, 1e16 * 3, 0.1 + 0.2)",
    "print(abs(-3), round(2.5), round(3.14159, 2), min(4, 2, 9), max(1.5, 1), int(7.9), float(3))",
    "print('answer:', 6 * 7)", "print()", "a = 1\nb = 2", "print(-(3 - 10), +4)", "print(1e308 * 10)",
    "print(3 ** 0.5, (-8) // 3)",
]
DECLINED = [
    "for i in range(3): print(i)", "import os\nprint(1)", "print(len('abc'))", "print('a' * 3)", "print(x)",
    "print(1 / 0)", "print(10 ** 10 ** 10)", "print(2 ** 5000)", "print(1.5 ** 10000)", "print(sum([1, 2]))",
    "print(1, sep='-')", "abs = 3\nprint(abs)", "print = 4", "x += 1", "print((-8) ** 0.5)", "print(True + 1)",
    "print(*[1, 2])", "print(open('f'))", "while True: pass", "print(round(1e308 * 10))",
    "print(" + " + ".join(["1"] * 300) + ")", "print('x' + 'y')", "print(int('3'))",
]


@pytest.mark.parametrize("code", SAME_OUTPUT)
def test_fast_path_prints_what_the_sandbox_prints(code):
    from agentkiln.sandbox import run_python

    fast, slow = run_in_process(code), run_python(code)
    assert fast is not None and slow.ok, (code, slow)
    assert (fast.ok, fast.stdout, fast.status) == (slow.ok, slow.stdout, slow.status)


@pytest.mark.parametrize("code", DECLINED)
def test_fast_path_declines_everything_else(code):

    assert run_in_process(code) is None


def test_fast_path_matches_the_sandbox_on_random_arithmetic():
    from agentkiln.sandbox import run_python

    rng = random.Random(0)

    def expr(depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([str(rng.randint(-30, 99)), f"{rng.uniform(-9, 9):.3f}", "x"])
        return f"({expr(depth - 1)} {rng.choice(['+', '-', '*', '/', '//', '%', '**'])} {expr(depth - 1)})"

    fast_count = 0
    for _ in range(60):
        code = f"x = {rng.randint(1, 9)}\nprint({expr(3)})"
        fast = run_in_process(code)
        slow = run_python(code)
        if fast is None:  # declined (division by zero, a complex power, ...): the sandbox answers
            continue
        fast_count += 1
        assert slow.ok and fast.stdout == slow.stdout, code
    assert fast_count >= 30


def test_tool_memoises_deterministic_sandbox_results_only():
    from agentkiln.envs.python_tool import _CACHE, run_tool

    code = "total = 0\nfor i in range(5): total += i\nprint(total)  # cache probe 1"
    _CACHE.pop(code, None)
    first, how1 = run_tool(code)
    second, how2 = run_tool(code)
    assert (how1, how2) == ("sandbox", "cached") and first.stdout == second.stdout == "10\n"
    assert run_tool("print(6 * 7)")[1] == "fast"
    slow = "import time\ntime.sleep(5)  # cache probe 2"
    _CACHE.pop(slow, None)
    res, how = run_tool(slow)
    assert res.status == "timeout" and how == "sandbox" and slow not in _CACHE  # may be the host's load


SYNTAX_ERRORS = ["print(1 +)", "x = = 2", "def f(:\n  pass", "  print(1)", "if True:\nprint(2)", "print('abc)",
                 "for i in range(3) print(i)", "\tx = 1\n        y = 2", "é☃ = ", "return 5", "1 = x", "(" * 250,
                 "print('\x00')"]


@pytest.mark.parametrize("code", SYNTAX_ERRORS)
def test_code_that_does_not_parse_gets_the_sandboxs_error_without_a_process(code):
    from agentkiln.sandbox import run_python

    fast, slow = run_in_process(code), run_python(code)
    if fast is None:  # a compiler-stage error (after parsing), or null bytes on Python < 3.12: the sandbox
        assert code in ("return 5", "print('\x00')") and slow.status == "error" and "Error" in slow.error
        return
    assert (fast.ok, fast.status, fast.error, fast.stdout, fast.stderr, fast.exit_code) == \
        (slow.ok, slow.status, slow.error, slow.stdout, slow.stderr, slow.exit_code)


def test_random_garbage_code_gets_the_sandboxs_answer():
    from agentkiln.envs.fuzz import random_text
    from agentkiln.sandbox import run_python

    rng = random.Random(1)
    for _ in range(40):
        code = random_text(rng) or "x"
        fast, slow = run_in_process(code), run_python(code)
        if fast is not None:
            assert (fast.ok, fast.status, fast.error, fast.stdout) == (slow.ok, slow.status, slow.error, slow.stdout), code


def test_all_three_tool_paths_give_the_same_observation():
    env = make(ARITHMETIC)
    env.reset()
    fast = env.step("python[print((10 + 5) * 3)]")
    env2 = make(ARITHMETIC)
    env2.reset()
    code = "print((10 + 5) * 3)\nif False: pass"  # not straight-line: the sandbox runs it
    slow = env2.step(f"python[{code}]")
    again = env2.step(f"python[{code}]")
    assert (fast.info["tool_path"], slow.info["tool_path"], again.info["tool_path"]) == ("fast", "sandbox", "cached")
    assert fast.observation.text == slow.observation.text == again.observation.text == "Output: 45"


@pytest.mark.parametrize("seed", range(12))
def test_sentence_oracle_writes_one_statement_per_sentence_and_wins(seed):
    knobs = {"kind": "arithmetic", "numbers": 6, "magnitude": 50, "ops": "+-*/", "steps": 3, "max_turns": 6}
    plain, task = gen.candidate(seed, knobs), gen.candidate(seed, {**knobs, "oracle": "sentences"})
    if task is None:
        return
    d = task.data
    # the same problem: the knob adds the program and draws nothing else
    assert "program" not in plain.data and {k: v for k, v in d.items() if k != "program"} == plain.data
    statements, sentences = d["program"].split("; "), d["question"].split(". ")
    assert len(statements) == len(sentences) == knobs["numbers"] + 1  # start, changes, distractors, question
    for sentence, statement in zip(sentences, statements[:-1]):
        person, value = statement.split(" = ")
        assert sentence.split()[0] in (person, "Each") and value.split()[-1] in sentence.split()
    env = make(task)
    env.reset()
    assert env.expert_action() == f"python[{d['program']}]"
    res = env.step(env.expert_action())
    assert res.observation.text == f"Output: {d['answer']}"
    assert env.step(env.expert_action()).reward == 1.0
