"""Environment steps per second per family, without any policy in the loop.

Each family is generated at `--level` (medium), then played by a cheap scripted actor: for families
with admissible lists, 80% a random admissible action and 20% a fuzz string; for free-form families
(tool calls), 50% the oracle's action (so the tools really run) and 50% a fuzz string. Resets are
counted in the time (amortised over episodes). One process, one thread: a per-core figure.

python-tool's `python[...]` steps are split by how the tool answered (`python:fast` in-process
arithmetic, `python:cached` a memoised sandbox result, `python:sandbox` a sandboxed process), and the
uncached sandbox is measured on its own (`sandbox_calls_per_s`: distinct programs, each in a fresh
sandboxed process), so the cost of a novel program is on record next to the mix's throughput.

    python bench/env_steps.py                       # all families -> bench/results/env_steps.json
    python bench/env_steps.py --families sokoban shop --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from agentkiln.envs import FAMILIES, env_class, make
from agentkiln.envs.fuzz import fuzz_action
from agentkiln.synthesis import generate

TARGETS = {"textworld": 100.0}  # steps/s on one core; every family of our own: 2,000
OWN_TARGET = 2000.0
TOOL = re.compile(r"^\s*(\w+)\[")


def bench_family(family: str, level: str, n_tasks: int, seconds: float, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tasks = generate(family, n_tasks, seed=seed, level=level, out_dir=tmp)
        gen_s = time.perf_counter() - t0
        free_form = env_class(family).free_form
        rng = random.Random(seed)
        steps = episodes = 0
        kinds: dict[str, list[float]] = {}  # action kind -> [steps, seconds] (free-form families)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            env = make(tasks[episodes % len(tasks)], tmp)
            obs = env.reset()
            episodes += 1
            done = False
            while not done:
                if free_form:
                    a = env.expert_action() if rng.random() < 0.5 else fuzz_action(rng, None)
                elif obs.admissible and rng.random() < 0.8:
                    a = rng.choice(obs.admissible)
                else:
                    a = fuzz_action(rng, obs.admissible)
                t = time.perf_counter()
                res = env.step(a)
                dt = time.perf_counter() - t
                if free_form:
                    m = TOOL.match(a) if isinstance(a, str) else None
                    kind = m.group(1) if m and not res.info["invalid"] else "other"
                    if "tool_path" in res.info:
                        kind += ":" + res.info["tool_path"]
                    k = kinds.setdefault(kind, [0, 0.0])
                    k[0] += 1
                    k[1] += dt
                obs, done = res.observation, res.done
                steps += 1
            env.close()
        elapsed = time.perf_counter() - start
    target = TARGETS.get(family, OWN_TARGET)
    out = {
        "level": level, "steps": steps, "episodes": episodes, "seconds": round(elapsed, 3),
        "steps_per_s": round(steps / elapsed, 1), "target_steps_per_s": target,
        "meets_target": steps / elapsed >= target, "generate_s_per_task": round(gen_s / n_tasks, 4),
    }
    if kinds:  # step cost by action kind, resets excluded: tool calls vs the rest
        out["steps_per_s_by_action"] = {k: round(n / s, 1) for k, (n, s) in sorted(kinds.items()) if s > 0}
        out["steps_by_action"] = {k: n for k, (n, _) in sorted(kinds.items())}
    if family == "python-tool":
        out["sandbox_calls_per_s"] = sandbox_calls_per_s(seconds)
    return out


def sandbox_calls_per_s(seconds: float) -> float:
    """Distinct small programs (never cached, never on the fast path), each in the sandbox."""
    from agentkiln.sandbox import run_python

    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        res = run_python(f"t = 0\nfor i in range({calls}): t += i\nprint(t)")
        assert res.ok, res
        calls += 1
    return round(calls / (time.perf_counter() - start), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    ap.add_argument("--level", default="medium")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/env_steps.json")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    results = {}
    for family in args.families:
        n = min(args.tasks, 5) if family == "textworld" else args.tasks  # TextWorld compiles games
        results[family] = r = bench_family(family, args.level, n, args.seconds, args.seed)
        flag = "ok" if r["meets_target"] else "BELOW TARGET"
        extra = f"  by action: {r['steps_per_s_by_action']}" if "steps_per_s_by_action" in r else ""
        print(f"{family:12s} {r['steps_per_s']:>10.1f} steps/s  (target {r['target_steps_per_s']:.0f}: {flag}){extra}")
    report = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                          "cores_used": 1}, "families": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
