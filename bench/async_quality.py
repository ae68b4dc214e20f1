"""Asynchronous RL against synchronous RL at the same budget: test and ood success over seeds.

Issue 23 asks that asynchronous RL (staleness 1) be no worse than synchronous: the paired 95% CI of
async - sync not entirely below 0 over at least 3 seeds. This runs the findings' protocol
(stages.findings: the pipeline's SFT policy, findings.base over rl.defaults, 768 episodes, one torch
thread per run, greedy on the frozen panels, params' findings seeds and workers) for two arms: the
default recipe (`sync`) and the same with `asynchronous.max_staleness: 1` and params' other
asynchronous settings (`async`), then writes the paired effect per panel and per task type to
bench/results/async_quality.json (and the findings-style report beside the runs in --runs).

    python bench/async_quality.py          # after `dvc repro sft` (or the whole pipeline): ~7 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.stages.findings import run_findings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="reports/async_quality", help="where the runs and their report go (cached by key)")
    ap.add_argument("--out", default="bench/results/async_quality.json", help="the JSON summary")
    args = ap.parse_args(argv)

    params = load_params()
    f = params.findings
    sync = f.arms["gigpo"]  # the default recipe: the findings' shared baseline
    arms = {"sync": sync, "async": sync.model_copy(update={"stages": [{"asynchronous": {"max_staleness": 1}}]})}
    claim = f.claims[0].model_copy(update={
        "id": "async_rl", "a": "sync", "b": "async", "paper": "Fu et al. 2025 (AReaL)",
        "claim": "asynchronous RL at staleness 1 trains no worse than synchronous RL at the same budget"})
    params = params.model_copy(update={"findings": f.model_copy(update={"arms": arms, "claims": [claim]})})
    report = run_findings(params, paths.TASKS, Path(args.runs))
    (result,) = report["claims"]
    a = params.rl.defaults.asynchronous
    out = {"asynchronous": {"max_staleness": 1, "correction": a.correction, "proximal": a.proximal,
                            "chunk_episodes": a.chunk_episodes, "worker": a.worker},
           "seeds": f.seeds, "arms": report["arms"], "panels": result["panels"],
           "not_worse": {panel: r["effect"]["ci_high"] > 0 for panel, r in result["panels"].items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for panel, r in result["panels"].items():
        e = r["effect"]
        print(f"async - sync on {panel}: {100 * e['diff']:+.1f} [{100 * e['ci_low']:+.1f}, {100 * e['ci_high']:+.1f}] points "
              f"({'not worse' if out['not_worse'][panel] else 'WORSE'})")
    print(f"wrote {args.out}; the runs and their report in {args.runs}")


if __name__ == "__main__":
    main()
