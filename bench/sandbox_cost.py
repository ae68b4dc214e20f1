"""Per-call cost of the tool sandbox: a python call and a SQL query, each a fresh sandboxed process.

    python bench/sandbox_cost.py                      # writes bench/results/sandbox_cost.json
    python bench/sandbox_cost.py --label before --out /tmp/before.json

Distinct programs (nothing cached, nothing on the python tool's in-process fast path), called one
after another on one core, after a warm-up (the zygote's start is reported apart). Reports the
median, p90 and mean milliseconds per call and calls per second, per tool, with the isolation level
that ran. `--baseline FILE` copies an earlier run (for example the sandbox before a change, measured
with this same script) into the output under "baseline", with the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _summary(times: list[float]) -> dict:
    ms = sorted(t * 1000 for t in times)
    return {"calls": len(ms), "median_ms": round(statistics.median(ms), 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "mean_ms": round(statistics.fmean(ms), 2),
            "calls_per_s": round(len(ms) / (sum(ms) / 1000), 1)}


def bench_python(calls: int) -> tuple[dict, float, str]:
    from agentkiln.sandbox import Limits, Sandbox

    lim = Limits(wall_s=10.0)
    with Sandbox() as box:
        t0 = time.perf_counter()
        res = box.run("print('warm')", lim)
        start_s = time.perf_counter() - t0
        assert res.ok, res
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            res = box.run(f"t = 0\nfor i in range({i}): t += i\nprint(t)", lim)
            times.append(time.perf_counter() - t0)
            assert res.ok and res.stdout == f"{i * (i - 1) // 2}\n", res
        return _summary(times), start_s, box.isolation


def bench_sql(calls: int) -> dict:
    from agentkiln.envs.sql import ReadOnlyDB, build_db
    from agentkiln.sandbox import Sandbox

    with Sandbox() as box:
        db = ReadOnlyDB(build_db(seed=0, tables=3, rows=40, columns=3), sandbox=box)
        db.query("SELECT 1")
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            cols, rows, _ = db.query(f"SELECT {i} + 1")
            times.append(time.perf_counter() - t0)
            assert rows == [(i + 1,)], rows
        return _summary(times)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per tool (default 300)")
    ap.add_argument("--label", default="after", help="what this run measures (default: after)")
    ap.add_argument("--baseline", help="an earlier output of this script to include, e.g. the sandbox before a change")
    ap.add_argument("--out", default="bench/results/sandbox_cost.json")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the caller on one core
    py, start_s, isolation = bench_python(args.calls)
    sql = bench_sql(args.calls)
    report = {"label": args.label, "commit": _commit(), "isolation": isolation,
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                          "load_1min": round(os.getloadavg()[0], 2)},
              "zygote_start_s": round(start_s, 3), "python": py, "sql": sql}
    print(f"{args.label} ({isolation}): python {py['median_ms']} ms median ({py['p90_ms']} p90), "
          f"sql {sql['median_ms']} ms median ({sql['p90_ms']} p90), zygote start {start_s:.3f} s")
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        base.pop("baseline", None)
        report["baseline"] = base
        report["median_ratio"] = {k: round(report[k]["median_ms"] / base[k]["median_ms"], 2) for k in ("python", "sql")}
        print(f"baseline {base['label']} at {base['commit']}: python {base['python']['median_ms']} ms, "
              f"sql {base['sql']['median_ms']} ms; ratio {report['median_ratio']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
