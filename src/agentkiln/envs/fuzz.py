"""Random and adversarial action strings for fuzzing an environment (tests and bench use them).

Mixes: admissible actions with typos, case and whitespace changes; tool-call syntax with broken
brackets and hostile payloads; control characters, unicode, very long strings; and non-strings.
"""

from __future__ import annotations

import random
import string

HOSTILE = [
    "", " ", "\n", "\x00", "\t\t", "None", "null", "[]", "{}", "()", "\\", "'", '"', "`", "$(reboot)",
    "; rm -rf /", "../../etc/passwd", "%s%s%s%n", "{0}", "{__import__}", "' OR 1=1 --", "DROP TABLE x;",
    "é☃🎲\u202e\ufeff", "\u0000\u0001\u001b[2J", "A" * 10_000, "[" * 500, "]" * 500,
    "search[", "search[]", "search]]", "click[", "click[]", "answer[", "answer[]", "answer[[x]]", "sql[",
    "sql[]", "sql[SELECT]", "sql[;;;]", "sql[PRAGMA writable_schema=1]", "sql[ATTACH DATABASE '/tmp/x' AS x]",
    "python[", "python[]", "python[)]", "python[while True: pass]", "python[import os; os.system('ls')]",
    "buy", "buy[now]", "back", "next", "prev", "go", "take", "push", "move", "left", "up", "noop",
]
VERBS = ["search", "click", "answer", "sql", "python", "go", "take", "push", "move", "buy", "open", "look"]


def mutate(action: str, rng: random.Random) -> str:
    ops = [
        lambda a: a.upper(),
        lambda a: " " + a + " ",
        lambda a: a[:-1],
        lambda a: a + a[-1:],
        lambda a: a.replace(" ", "  "),
        lambda a: a[: rng.randint(0, len(a))],
        lambda a: "".join(rng.sample(a, len(a))),
        lambda a: a + rng.choice(HOSTILE),
        lambda a: a.replace("[", "(").replace("]", ")"),
    ]
    return rng.choice(ops)(action) if action else rng.choice(HOSTILE)


def random_text(rng: random.Random, max_len: int = 60) -> str:
    alphabet = string.printable + "éß☃🎲\u200b\x00\x7f"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def fuzz_action(rng: random.Random, admissible: list[str] | None) -> object:
    """One fuzz action: admissible-like, tool-like, hostile, random text or not a string at all."""
    r = rng.random()
    if r < 0.25 and admissible:
        return mutate(rng.choice(admissible), rng)
    if r < 0.45:
        return f"{rng.choice(VERBS)}[{rng.choice(HOSTILE + [random_text(rng)])}]"
    if r < 0.65:
        return rng.choice(HOSTILE)
    if r < 0.97:
        return random_text(rng)
    return rng.choice([None, 42, 3.5, b"bytes", ["go", "east"], {"action": "go"}])
