"""Generator of `python-tool` tasks (agentkiln.envs.python_tool): seeded countdown and arithmetic
word problems.

Countdown: `numbers` numbers drawn from [1, magnitude]; `steps + 1` of them are combined by `steps`
random allowed operations into the target, every intermediate result a positive integer (a
subtraction takes the larger first, a division must be exact, a multiplication never by 1). The
target is never one of the numbers. A shorter solution may exist: `steps` bounds the solution
length from above.

Arithmetic: a quantity starts in [2, magnitude] and changes `steps` times by allowed operations
(+ and - by up to `magnitude`, * and exact / by 2 to 9); `numbers - steps - 1` sentences about
other people's things add distracting numbers.

The oracle's program (knob `oracle`): `expression` prints the solution expression,
`python[print(3 - 1 + 26)]`; `sentences` (arithmetic only) writes one statement per sentence of the
question, distractors included, `python[Ava = 3; Ava = Ava - 1; Ava = Ava + 26; Leo = 50; print(Ava)]`,
kept in the task's data as `program`. Each statement copies its numbers from one sentence, so a
demonstration never asks the policy to find a number several sentences away (docs/rl.md, session 17
of issue 22: SFT +26.7 points on the test panel over 3 seeds).

A task's data is the whole problem (question, numbers, operators, target or answer, the oracle's
solution expression, with `oracle: sentences` its program): a few hundred bytes, nothing to rebuild.
"""

from __future__ import annotations

import random
import sys
from fractions import Fraction

from agentkiln import sandbox
from agentkiln.envs import python_fastpath
from agentkiln.envs.base import TaskSpec
from agentkiln.synthesis.generate import check_int_knobs

# the tool's outputs (tracebacks, float reprs) depend on the interpreter that runs the sandbox
VERSION = f"python-{sys.version_info[0]}.{sys.version_info[1]}"
SOURCES = (sandbox.server.__file__, python_fastpath.__file__)  # code outside the family's modules that shapes its observations
LEVELS: dict[str, dict] = {
    "easy": {"kind": "mixed", "numbers": 3, "magnitude": 20, "ops": "+-", "steps": 1, "max_turns": 4, "oracle": "expression"},
    "medium": {"kind": "mixed", "numbers": 4, "magnitude": 50, "ops": "+-*", "steps": 2, "max_turns": 6, "oracle": "expression"},
    "hard": {"kind": "mixed", "numbers": 6, "magnitude": 100, "ops": "+-*/", "steps": 4, "max_turns": 8, "oracle": "expression"},
}
KINDS = ("countdown", "arithmetic", "mixed")
ORACLES = ("expression", "sentences")
RANGES = {"numbers": (2, 8), "magnitude": (10, 1000), "steps": (1, 7), "max_turns": (2, 50)}
NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max")  # no pronouns: distractors name others
ITEMS = ("shells", "cards", "stamps", "marbles", "coins", "beads", "stickers", "apples", "books", "pens")
MAX_VALUE = 1_000_000


def check(knobs: dict) -> None:
    check_int_knobs("python-tool", knobs, RANGES)
    if knobs.get("kind") not in KINDS:
        raise ValueError(f"python-tool: knob kind = {knobs.get('kind')!r}: must be one of {', '.join(KINDS)}")
    if knobs.get("oracle") not in ORACLES:
        raise ValueError(f"python-tool: knob oracle = {knobs.get('oracle')!r}: must be one of {', '.join(ORACLES)}")
    ops = knobs.get("ops")
    if not isinstance(ops, str) or not ops or set(ops) - set("+-*/") or len(set(ops)) != len(ops):
        raise ValueError(f"python-tool: knob ops = {ops!r}: must be a non-empty string of distinct operators "
                         "from + - * /")
    if knobs["steps"] > knobs["numbers"] - 1:
        raise ValueError(f"python-tool: knob steps = {knobs['steps']}: must be at most numbers - 1 = "
                         f"{knobs['numbers'] - 1}")


def _canonical(ops: str) -> str:
    return "".join(o for o in "+-*/" if o in ops)


def countdown(rng: random.Random, numbers: int, magnitude: int, ops: str, steps: int) -> dict | None:
    nums = sorted(rng.randint(1, magnitude) for _ in range(numbers))
    pool = [(Fraction(nums[i]), str(nums[i]), False) for i in sorted(rng.sample(range(numbers), steps + 1))]
    for _ in range(steps):
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        options = []
        for op in ops:
            x, y = (a, b) if a[0] >= b[0] else (b, a)  # larger first: no negative or fractional steps
            if op == "+" or (op == "-" and x[0] > y[0]) or (op == "*" and y[0] > 1):
                options.append((op, x, y))
            elif op == "/" and y[0] > 1 and (x[0] / y[0]).denominator == 1:
                options.append((op, x, y))
        if not options:
            return None
        op, x, y = rng.choice(options)
        value = {"+": x[0] + y[0], "-": x[0] - y[0], "*": x[0] * y[0], "/": x[0] / y[0]}[op]
        text = " ".join((f"({x[1]})" if x[2] else x[1], op, f"({y[1]})" if y[2] else y[1]))
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(value, text, True)]
    target = pool[0][0]
    if target in nums or target > MAX_VALUE:
        return None  # trivial (no operation needed) or absurd
    question = (f"Using the numbers {' '.join(map(str, nums))}, each at most once, with {' '.join(ops)} and "
                f"parentheses, make {target}.")
    return {"kind": "countdown", "question": question, "numbers": nums, "ops": ops, "target": int(target),
            "solution": pool[0][1]}


def arithmetic(rng: random.Random, numbers: int, magnitude: int, ops: str, steps: int) -> dict | None:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    v = start = rng.randint(2, magnitude)
    expr, additive = str(v), False  # additive: the expression ends in + or - (wrap before * and //)
    sentences, statements = [], []  # statements: the oracle's program, one per sentence (oracle: sentences)
    for _ in range(steps):
        divisors = [d for d in range(2, 10) if v % d == 0 and d < v]
        options = [op for op in ops if op == "+" or (op == "-" and v >= 2) or (op == "*" and v * 9 <= MAX_VALUE)
                   or (op == "/" and divisors)]
        if not options:
            return None
        op = rng.choice(options)
        if op == "+":
            b = rng.randint(1, magnitude)
            v, expr, additive = v + b, f"{expr} + {b}", True
            sentences.append(f"{name} gets {b} more {item}.")
            statements.append(f"{name} = {name} + {b}")
        elif op == "-":
            b = rng.randint(1, min(v - 1, magnitude))
            v, expr, additive = v - b, f"{expr} - {b}", True
            sentences.append(f"{name} gives away {b} {item}.")
            statements.append(f"{name} = {name} - {b}")
        elif op == "*":
            b = rng.randint(2, 9)
            v, expr, additive = v * b, f"({expr}) * {b}" if additive else f"{expr} * {b}", False
            sentences.append(f"Each of {name}'s {item} is then traded for {b} new ones.")
            statements.append(f"{name} = {name} * {b}")
        else:
            d = rng.choice(divisors)
            v, expr, additive = v // d, f"({expr}) // {d}" if additive else f"{expr} // {d}", False
            sentences.append(f"{name} splits the {item} into {d} equal groups and keeps one group.")
            statements.append(f"{name} = {name} // {d}")
    others = [n for n in NAMES if n != name]
    for _ in range(numbers - steps - 1):  # distractors: numbers that play no part in the answer
        other, thing = rng.choice(others), rng.choice([i for i in ITEMS if i != item])
        at, n = rng.randint(0, len(sentences)), rng.randint(2, magnitude)
        sentences.insert(at, f"{other} has {n} {thing}.")
        statements.insert(at, f"{other} = {n}")
    question = " ".join([f"{name} has {start} {item}.", *sentences,
                         f"How many {item} does {name} have now?"])
    program = "; ".join([f"{name} = {start}", *statements, f"print({name})"])
    return {"kind": "arithmetic", "question": question, "answer": v, "solution": expr, "program": program}


def candidate(seed: int, knobs: dict, out_dir=None) -> TaskSpec | None:
    rng = random.Random(seed)
    kind = knobs["kind"] if knobs["kind"] != "mixed" else rng.choice(("countdown", "arithmetic"))
    make = countdown if kind == "countdown" else arithmetic
    data = make(rng, knobs["numbers"], knobs["magnitude"], _canonical(knobs["ops"]), knobs["steps"])
    if data is None:
        return None  # no valid operation somewhere: the shared generate() retries with another seed
    if knobs.get("oracle", "expression") != "sentences":
        data.pop("program", None)  # the expression oracle's tasks keep their bytes
    return TaskSpec(task_id=f"python-tool-{seed}", family="python-tool", seed=seed, data=data)
