"""Answer the python tool in-process where that gives the sandbox's exact result, or decline.

Most `python[...]` calls an agent makes on arithmetic problems are straight-line arithmetic:
`print((50 + 25) * 7 / 3)`, `x = 12 * 4; print(x - 5)`. A process-level sandbox costs milliseconds
a call; walking the AST of such a program costs microseconds. `run_arithmetic(code)` interprets a
program only when every node is in a small whitelist, never calls `eval`/`exec`, and bounds every
value (integers of at most MAX_INT_BITS bits, round's digits at most MAX_NDIGITS, a bounded number of
statements and nodes, bounded output), so it cannot loop, allocate much or touch anything outside its
own dict of variables: every operation it performs costs at most a multiplication of two
MAX_INT_BITS-bit integers (the trainer's process never runs model-written work unbounded).

The values are computed by the interpreter's own operators and printed with `str`, so the output is
byte-identical to what the sandbox's `print` writes (the sandbox runs the same Python). Anything
else (a loop, an import, a string operation, an unknown name, a keyword argument, an exception of
any kind, an over-large value) returns None and the caller runs the code in the sandbox, which then
produces the real traceback. tests/test_python_tool.py checks the equality on many programs.

A program that does not parse never runs at all: its SyntaxError is formatted as the sandbox formats
it (same parser, same file name, same traceback code), so garbage code costs no process either.

Subset: statements `name = expr`, `name op= expr` and `print(expr, ...)`; expressions: int, float
and str literals (str only as a print argument), names assigned earlier, + - * / // % ** and unary
+ -, calls of abs / round / min / max / int / float with positional arguments.
"""

from __future__ import annotations

import ast
import operator
import traceback

from agentkiln.sandbox import SandboxResult
from agentkiln.sandbox.server import last_line

MAX_INT_BITS = 2048  # far below int -> str's 4300-digit limit; bigger values go to the sandbox
MAX_NDIGITS = 700  # round(x, n): |n| digits, beyond MAX_INT_BITS' ~617 digits, go to the sandbox
MAX_STATEMENTS = 64
MAX_NODES = 512
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS = {"abs": abs, "round": round, "min": min, "max": max, "int": int, "float": float}
_RESERVED = frozenset(_FUNCS) | {"print"}


class _Decline(Exception):
    """Not in the subset (or would misbehave): the sandbox runs it."""


def _number(v):
    if type(v) not in (int, float):  # bool and str are not arithmetic here
        raise _Decline
    if type(v) is int and v.bit_length() > MAX_INT_BITS:
        raise _Decline
    return v


def _pow_ok(a, b) -> bool:
    """Whether a ** b stays small: integer powers are bounded by bits(a) * b before computing."""
    if type(a) is int and type(b) is int and b > 0:
        return abs(a) <= 1 or a.bit_length() * b <= MAX_INT_BITS
    return abs(b) <= 10_000  # float or negative powers: floats cannot grow without bound


def _eval(node: ast.AST, names: dict):
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise _Decline  # NameError or a builtin: the sandbox says what happens
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left, names), _eval(node.right, names)
        if type(node.op) is ast.Mult and type(a) is int and type(b) is int \
                and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise _Decline
        if type(node.op) is ast.Pow and not _pow_ok(a, b):
            raise _Decline
        return _number(_BINOPS[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_eval(node.operand, names)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
            and node.func.id not in names and not node.keywords:
        args = [_eval(a, names) for a in node.args]
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise _Decline
        if node.func.id == "round" and len(args) == 2 and (type(args[1]) is not int or abs(args[1]) > MAX_NDIGITS):
            raise _Decline  # round(7, -10**8) computes 10**(10**8): the sandbox's limits stop that
        return _number(_FUNCS[node.func.id](*args))
    raise _Decline


def _print_arg(node: ast.AST, names: dict) -> str:
    if isinstance(node, ast.Constant) and type(node.value) is str:
        return node.value
    return str(_eval(node, names))


def _run(tree: ast.Module, max_output: int) -> str:
    names: dict = {}
    out: list[str] = []
    size = 0
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target = stmt.targets[0].id
            if target in _RESERVED:
                raise _Decline
            names[target] = _eval(stmt.value, names)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and type(stmt.op) in _BINOPS:
            target = stmt.target.id
            if target in _RESERVED or target not in names:
                raise _Decline
            names[target] = _eval(ast.BinOp(ast.Name(target), stmt.op, stmt.value), names)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print" \
                and not stmt.value.keywords and not any(isinstance(a, ast.Starred) for a in stmt.value.args):
            line = " ".join(_print_arg(a, names) for a in stmt.value.args) + "\n"
            size += len(line.encode())
            if size > max_output:
                raise _Decline  # the sandbox reports the truncation
            out.append(line)
        else:
            raise _Decline
    return "".join(out)


def _syntax_error(e: SyntaxError) -> SandboxResult:
    """What the sandbox returns for code that does not compile (see sandbox._print_exception)."""
    stderr = "".join(traceback.TracebackException(type(e), e, None, lookup_lines=False, compact=True).format())
    return SandboxResult(ok=False, stdout="", stderr=stderr, error=last_line(stderr) or "exit status 1",
                         status="error", exit_code=1)


def run_in_process(code: str, max_output: int = 4096) -> SandboxResult | None:
    """The sandbox's result for `code` if it does not parse or is a straight-line arithmetic program,
    else None (run it in the sandbox)."""
    try:  # the sandbox compiles with this file name: the same parser raises the same error
        tree = ast.parse(code, filename="<sandbox>", mode="exec")
    except SyntaxError as e:  # IndentationError and TabError included
        return _syntax_error(e)
    except (ValueError, RecursionError, MemoryError):  # null bytes, nesting: the sandbox decides
        return None
    if len(tree.body) > MAX_STATEMENTS or sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return None
    try:
        stdout = _run(tree, max_output)
    except (_Decline, ArithmeticError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return SandboxResult(ok=True, stdout=stdout, stderr="", error=None, status="ok", exit_code=0)
