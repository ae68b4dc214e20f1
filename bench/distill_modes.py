"""Distil the pipeline's RL teacher with each distillation mode and evaluate every student on the
frozen test panel, greedy, with a paired comparison against the teacher.

Run after `dvc repro` (needs data/tasks and the last RL stage's model):

    python bench/distill_modes.py                       # trajectory, forward-kl, on-policy
    python bench/distill_modes.py --modes on-policy

Students go to models/distill_modes/<mode>/ (not a DVC output); results to
bench/results/distill_modes.json (per mode: success with Wilson CI, ratio to the teacher, paired
difference with a bootstrap CI, parameters, seconds, the stage's report).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.evaluate.harness import outcomes, panel_summary, play
from agentkiln.panels import load_panel, panel_id
from agentkiln.stats import compare_paired
from agentkiln.policy import load_policy
from agentkiln.seeding import seed_everything
from agentkiln.stages.distill import run_distill
from agentkiln.evaluate.agents import greedy_agent, task_levels

MODES = ("trajectory", "forward-kl", "on-policy")


def evaluate(policy, params, tasks, levels) -> list[dict]:
    return play(greedy_agent("policy", policy, params), tasks, paths.TASKS, params.evaluate.max_turns, levels=levels, panel="test")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default="models/distill_modes")
    ap.add_argument("--results", default="bench/results/distill_modes.json")
    args = ap.parse_args()

    params = load_params()
    ev = params.evaluate
    tasks, levels = load_panel(paths.TASKS, "test"), task_levels(params)
    teacher_dir = paths.model_dirs(params)["rl"]
    seed_everything(params.seed, params.torch_threads)
    teacher = load_policy(teacher_dir)
    t_recs = evaluate(teacher, params, tasks, levels)
    t_sum = panel_summary(t_recs, ev.confidence)
    results = {"panel": panel_id(paths.TASKS, "test"), "teacher": teacher_dir.as_posix(),
               "teacher_params": teacher.n_params(), "teacher_success": t_sum, "modes": {}}
    print(f"teacher {teacher_dir}: {100 * t_sum['success']:.1f}% [{100 * t_sum['ci_low']:.1f}, {100 * t_sum['ci_high']:.1f}]")
    for mode in args.modes:
        p = params.model_copy(update={"distill": params.distill.model_copy(update={"mode": mode})})
        seed_everything(params.seed, params.torch_threads)
        start = time.perf_counter()
        report = run_distill(p, paths.TASKS, teacher_dir, Path(args.out) / mode)
        seconds = time.perf_counter() - start
        student = load_policy(Path(args.out) / mode)
        recs = evaluate(student, params, tasks, levels)
        s = panel_summary(recs, ev.confidence)
        cmp = compare_paired(outcomes(recs), outcomes(t_recs), ev.confidence, ev.n_boot, ev.seed)
        results["modes"][mode] = {"success": s, "ratio_to_teacher": s["success"] / max(t_sum["success"], 1e-9),
                                  "vs_teacher": cmp, "student_params": student.n_params(), "seconds": round(seconds, 1),
                                  "report": {k: v for k, v in report.items() if k != "rounds"},
                                  "rounds": report.get("rounds", [])}
        print(f"{mode}: {100 * s['success']:.1f}% [{100 * s['ci_low']:.1f}, {100 * s['ci_high']:.1f}] = "
              f"{100 * results['modes'][mode]['ratio_to_teacher']:.0f}% of the teacher; student - teacher "
              f"{100 * cmp['diff']:+.1f} [{100 * cmp['ci_low']:+.1f}, {100 * cmp['ci_high']:+.1f}]; "
              f"{student.n_params():,} vs {teacher.n_params():,} parameters; {seconds:.0f} s")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
