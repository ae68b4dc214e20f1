"""`python-tool`: arithmetic problems solved with a sandboxed Python tool.

Two kinds of problem, generated from a seed (agentkiln.synthesis.python_tool):
- countdown: "Using the numbers 3 7 25 50, each at most once, with + - * and parentheses, make 175."
  The answer is an expression such as `(50 + 25) * 7 / 3`.
- arithmetic: a word problem whose quantity changes `steps` times, with distracting facts, e.g.
  "Mia has 37 shells. Tom has 12 cards. Mia gets 15 more shells. She splits her shells into 4 equal
  groups and keeps one group. How many shells does Mia have now?" The answer is a number.

Actions (free-form, `admissible` is None):
- `python[code]` runs `code` in the sandbox (agentkiln.sandbox: no network, no files outside a
  temporary directory, 2 s wall / 1 s CPU / 256 MiB); the observation is its printed output (first
  300 characters) or its error. A well-formed call whose code fails is a valid step: the error is
  the tool's answer. Two shortcuts give the same observation faster (`run_tool`): straight-line
  arithmetic runs, and code that does not parse is rejected, in-process (agentkiln.envs.python_fastpath,
  microseconds instead of milliseconds),
  and a sandbox result that depends only on the code is memoised (GRPO groups repeat calls), which
  also makes a repeated call's observation reproducible.
- `answer[value]` ends the episode.
Anything else (unknown verb, missing brackets, empty or too long argument) is an invalid step whose
observation shows both forms.

Reward: 1.0 for a correct answer, else 0.0. A countdown answer is parsed with `ast` (never eval'd):
only integer literals, the allowed operators and parentheses; each number used at most as often as
given; evaluated exactly with fractions, it must equal the target (`... = 175` is accepted). An
arithmetic answer must hold exactly one number, equal to the gold answer (commas and units allowed).

Knobs: `kind` (countdown | arithmetic | mixed, drawn per task), `numbers` (how many numbers the
problem shows: state size), `magnitude` (largest number), `ops` (allowed operators: action space),
`steps` (operations in the solution: solution length), `max_turns`.

Oracle: `python[print(<solution expression>)]` (or, where the task's data holds a `program`, the
generator's `oracle: sentences`, `python[<program>]`: one statement per sentence), then, once a tool
output showed the gold value, `answer[<expression or number>]`.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from collections import OrderedDict

from agentkiln.envs.base import Env, Observation, StepResult, anchor_of, tool_call
from agentkiln.envs.python_fastpath import run_in_process
from agentkiln.sandbox import Limits, SandboxResult, run_python

MAX_CODE_CHARS = 2000
MAX_ANSWER_CHARS = 200
MAX_SHOWN_CHARS = 300
VALID = ["python[code]", "answer[value]"]
LIMITS = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, output_bytes=4096, file_size_kb=256, max_files=16)
CACHE_SIZE = 4096  # memoised sandbox results (per process)
# outcomes decided by the code alone (CPU time is the code's own, unlike wall time); a wall-clock
# timeout or a sandbox failure may be the host's load, so it is run again next time
CACHED_STATUSES = frozenset({"ok", "error", "cpu", "memory", "output", "file_size", "disk", "denied"})
_CACHE: OrderedDict[str, SandboxResult] = OrderedDict()
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")  # 1,234.5 | 42 | .5


def eval_countdown(text: str, numbers: list[int], ops: str) -> tuple[Fraction | None, str]:
    """(value, "") of a countdown expression, or (None, why it is not acceptable). Walks the AST:
    integer literals, allowed binary operators and parentheses only; numbers as a sub-multiset."""
    text = text.split("=")[0].strip()
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, "it is not an arithmetic expression"
    pool = list(numbers)

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if node.value not in pool:
                raise ValueError(f"{node.value} is not an available number")
            pool.remove(node.value)
            return Fraction(node.value)
        op = _OPS.get(type(node.op)) if isinstance(node, ast.BinOp) else None
        if op is not None and op in ops:
            a, b = value(node.left), value(node.right)
            if op == "/" and b == 0:
                raise ValueError("it divides by zero")
            return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
        raise ValueError(f"only the numbers, {' '.join(ops)} and parentheses are allowed")

    try:
        return value(tree.body), ""
    except ValueError as e:
        return None, str(e)
    except RecursionError:
        return None, "it is nested too deeply"


def numbers_in(text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in _NUMBER.findall(text)]


def _fmt(x: Fraction | float) -> str:
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"


def run_tool(code: str) -> tuple[SandboxResult, str]:
    """(result, how it was obtained: "fast" | "cached" | "sandbox") of the python tool on `code`."""
    res = run_in_process(code, LIMITS.output_bytes)
    if res is not None:
        return res, "fast"
    if code in _CACHE:
        _CACHE.move_to_end(code)
        return _CACHE[code], "cached"
    res = run_python(code, LIMITS)
    if res.status in CACHED_STATUSES:
        _CACHE[code] = res
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return res, "sandbox"


class PythonToolEnv(Env):
    family = "python-tool"
    free_form = True
    max_reply_tokens = 64
    tools = (("python", "code", "Run Python code in a sandbox and see what it prints."),
             ("answer", "value", "Give the final answer."))

    def _reset(self) -> Observation:
        d = self.task.data
        self.kind = d["kind"]
        self.gold = Fraction(d["target"] if self.kind == "countdown" else d["answer"])
        self.goal = d["question"]
        self.checked = False  # a tool output has shown the gold value (the oracle then answers)
        what = "an expression" if self.kind == "countdown" else "a number"
        text = (f"{d['question']} Use python[code] to run Python (print what you need) and answer[...] to "
                f"give {what}.")
        return Observation(text, None, anchor_of("python-tool", self.goal, "start"))

    def _step(self, action: str) -> StepResult:
        call = tool_call(action, ("python", "answer"))
        if call is None:
            return self.invalid(action, "use python[code] or answer[value]", VALID)
        tool, arg = call
        if tool == "answer":
            if not arg or len(arg) > MAX_ANSWER_CHARS:
                return self.invalid(action, f"an answer has 1 to {MAX_ANSWER_CHARS} characters", VALID)
            won, why = self._judge(arg)
            text = "Your answer is correct." if won else f"Your answer is wrong: {why}."
            obs = Observation(text, None, anchor_of("python-tool", self.goal, "answered", won))
            return StepResult(obs, float(won), True, {"won": won, "invalid": False})
        if not arg or len(arg) > MAX_CODE_CHARS:
            return self.invalid(action, f"code has 1 to {MAX_CODE_CHARS} characters", VALID)
        res, path = run_tool(arg)
        text = self._render(res)
        if res.ok:
            nums = numbers_in(res.stdout)
            self.checked = self.checked or any(abs(x - float(self.gold)) <= 1e-6 * max(1.0, abs(x)) for x in nums)
        obs = Observation(text, None, anchor_of("python-tool", self.goal, text))
        return StepResult(obs, 0.0, False, {"won": False, "invalid": False, "tool_error": not res.ok,
                                            "tool_status": res.status, "tool_path": path})

    @staticmethod
    def _render(res) -> str:
        """The tool's answer, deterministic for deterministic code: a timed-out run's partial output
        depends on timing, so it is not shown."""
        def cut(s: str) -> str:
            s = " ".join(s.split())
            return s if len(s) <= MAX_SHOWN_CHARS else s[:MAX_SHOWN_CHARS] + " ..."

        if res.ok:
            return f"Output: {cut(res.stdout)}" if res.stdout.strip() else "Output: (nothing printed, use print)"
        if res.status in ("timeout", "cpu"):
            return "Error: time limit exceeded."
        if res.status == "output":
            return f"Error: output too long. Output: {cut(res.stdout)}"
        shown = f" Output: {cut(res.stdout)}" if res.stdout.strip() else ""
        return f"Error: {cut(res.error or res.status)}.{shown}"

    def _judge(self, arg: str) -> tuple[bool, str]:
        d = self.task.data
        if self.kind == "countdown":
            value, why = eval_countdown(arg, d["numbers"], d["ops"])
            if value is None:
                return False, why
            return value == self.gold, f"it makes {_fmt(value)}, not {_fmt(self.gold)}"
        nums = numbers_in(arg)
        if len(nums) != 1:
            return False, "give exactly one number"
        return abs(nums[0] - float(self.gold)) <= 1e-6 * max(1.0, abs(float(self.gold))), "that is not it"

    def expert_distance(self, limit: int = 0) -> int | None:
        """The oracle's plan is two calls (print the solution, answer), one once an output showed the
        gold value; None after a wrong answer."""
        if not self._started:
            return None
        if self.won:
            return 0
        if self.done and not self.truncated:
            return None
        return 1 if self.checked else 2

    def _expert(self) -> str | None:
        d = self.task.data
        if not self.checked:
            return f"python[{d['program']}]" if "program" in d else f"python[print({d['solution']})]"
        return f"answer[{d['solution'] if self.kind == 'countdown' else _fmt(self.gold)}]"
