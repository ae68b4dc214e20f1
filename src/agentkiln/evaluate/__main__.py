"""Evaluate any policy on any frozen panel with one command.

    python -m agentkiln.evaluate --model models:/agentkiln-policy@champion --panel test
    python -m agentkiln.evaluate --model sft --model rl --panel ood --samples 8   # + paired comparison, pass@k
    python -m agentkiln.evaluate --model models/sft --play 2                      # a directory; show 2 episodes
    python -m agentkiln.evaluate --model models/checkpoints/rl/main               # a running (or killed) RL stage's
                                                                                  # checkpoint: gone once it finishes

A model is `random` or `oracle` (baselines), a pipeline name (`sft`, `rl`, `distilled`), a registry
URI (`models:/<name>@<alias>` or `models:/<name>/<version>`), a saved policy directory, or an RL
checkpoint directory (its starting model comes from params.yaml, or --init). The panel's manifest
is checked first: a tampered panel or one from other environment code is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentkiln import paths
from agentkiln.evaluate.sources import resolve_policy, source_problem, transcript


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentkiln.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="repeat to compare (each vs the first)")
    ap.add_argument("--panel", default="test", help="a split with a manifest under --tasks (test, ood, ...)")
    ap.add_argument("--tasks", default=str(paths.TASKS), help="tasks directory (default data/tasks)")
    ap.add_argument("--samples", type=int, default=0, help="n sampled episodes per task for pass@k (0: greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    ap.add_argument("--init", default=None, help="starting model of an RL checkpoint (default: from params.yaml)")
    ap.add_argument("--play", type=int, default=0, help="print the first N greedy episodes of each model")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    for source in args.model:  # a wrong path is said now, not after the imports below (seconds)
        if (problem := source_problem(source)) is not None:
            print(f"agentkiln evaluate: {problem}", file=sys.stderr)
            return 2

    from agentkiln.config import ParamsError, load_params
    from agentkiln.evaluate.harness import pass_at_k_curve, panel_summary, records, success_rates
    from agentkiln.panels import load_panel, panel_id
    from agentkiln.evaluate.report import comparison_table, efficiency_table, family_table, markdown_table, pass_k_table
    from agentkiln.stats import compare_paired
    from agentkiln.rollout.engine import run_episodes
    from agentkiln.seeding import seed_everything
    from agentkiln.evaluate.agents import greedy_agent, pass_k_ks, policy_agent, task_levels

    try:
        params = load_params(args.params)
        tasks = load_panel(args.tasks, args.panel)
    except (ParamsError, FileNotFoundError, ValueError) as e:
        print(f"agentkiln evaluate: {e}", file=sys.stderr)
        return 2
    seed_everything(params.seed, params.torch_threads)
    levels, ev = task_levels(params), params.evaluate
    metrics, per_task, sampled = {}, {}, {}
    for source in args.model:
        try:
            policy = resolve_policy(source, params, args.init)
        except (FileNotFoundError, ValueError, OSError) as e:
            print(f"agentkiln evaluate: {e}", file=sys.stderr)
            return 2
        name = source
        agent = greedy_agent(source if source in ("random", "oracle") else "policy", policy, params)
        episodes = run_episodes(agent, tasks, args.tasks, ev.max_turns, progress=f"eval {name}")
        for e in episodes[: args.play]:
            print(transcript(e))
        recs = records(episodes, tasks, 1, levels, args.panel)
        metrics[name] = panel_summary(recs, ev.confidence) | {"n_params": policy.n_params() if policy else None}
        per_task[name] = [int(r["won"]) for r in recs]
        if args.samples and policy is not None:
            sampler = policy_agent(policy, ev, temperature=args.temperature, seed=ev.seed)
            eps = run_episodes(sampler, tasks, args.tasks, ev.max_turns, group_size=args.samples, progress=f"pass@k {name}")
            srecs = records(eps, tasks, args.samples, levels, args.panel)
            curve = pass_at_k_curve(srecs, pass_k_ks(args.samples))
            metrics[name] |= {"pass_at_k": {str(k): v for k, v in curve.items()}, "pass_at_k_samples": args.samples}
            sampled[name] = list(success_rates(srecs).values())
    first = args.model[0]
    comparisons = [{"a": m, "b": first, "decoding": "greedy",
                    **compare_paired(per_task[m], per_task[first], ev.confidence, ev.n_boot, ev.seed)}
                   for m in args.model[1:]]
    comparisons += [{"a": m, "b": first, "decoding": f"sampled T={args.temperature:g} x{args.samples}",
                     **compare_paired(sampled[m], sampled[first], ev.confidence, ev.n_boot, ev.seed)}
                    for m in args.model[1:] if m in sampled and first in sampled]
    print(f"\nPanel {args.panel} ({len(tasks)} tasks, manifest {panel_id(args.tasks, args.panel)})\n")
    print(markdown_table(metrics) + "\n\n" + family_table(metrics) + "\n\n" + efficiency_table(metrics))
    if table := pass_k_table(metrics):
        print("\n" + table)
    if comparisons:
        print("\n" + comparison_table(comparisons))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"panel": args.panel, "panel_id": panel_id(args.tasks, args.panel),
                                              "metrics": metrics, "comparisons": comparisons, "outcomes": per_task},
                                             indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
