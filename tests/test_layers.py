"""The packages form layers: no import cycle between them, counting imports inside functions (an
import hidden in a function to dodge a cycle is still a cycle of the design)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agentkiln"


def unit(path: Path) -> str:
    """A package's name (agentkiln/<package>/...) or a top-level module's (agentkiln/<module>.py)."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_units(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "agentkiln" and len(parts) > 1 and (
                    (SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").is_file()):
                out.add(parts[1])
                break  # `from agentkiln.x import y`: the unit is x, whatever y is
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        me = unit(f)
        edges.setdefault(me, set()).update(u for u in imported_units(f) if u != me)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_packages():
    edges = graph()
    assert {"config", "envs", "synthesis", "evaluate", "stages", "trainers"} <= set(edges)  # it saw the code
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def test_the_leaves_import_nothing_of_the_project():
    edges = graph()
    for leaf in ("errors", "stats", "families", "seeding"):
        assert edges[leaf] == set(), f"agentkiln.{leaf} imports {sorted(edges[leaf])}: it is meant to be a leaf"
    assert edges["config"] <= {"algos", "errors", "families"}, edges["config"]
