"""The ablation: arms validated at the same budget, statistics per arm, reports, one arm trained."""

import numpy as np
import pytest
import yaml

from agentkiln.config import ParamsError, load_params
from agentkiln.evaluate.ablation_report import write_ablation_reports
from agentkiln.stages.ablation import summarize, train_arm
from tests.test_config import ROOT, write


def test_arms_must_share_the_rollout_budget(tmp_path):
    p = load_params(ROOT / "params.yaml")
    budgets = {arm: sum(s.episode_budget for s in p.ablation_stages(arm)) for arm in p.ablation.arms}
    assert len(set(budgets.values())) == 1
    assert [s.max_turns for s in p.ablation_stages("scaling_h6_h12")] == [6, 12]  # ScalingInter: a growing horizon
    path = write(tmp_path, lambda r: r["ablation"]["arms"].update(big=[{"algorithm": "grpo", "episode_budget": 9999}]))
    with pytest.raises(ParamsError, match="rollout budgets differ"):
        load_params(path)
    path = write(tmp_path, lambda r: r["ablation"]["arms"].update(bad=[{"algorithm": "sarsa"}]))
    with pytest.raises(ParamsError, match="ablation.arms.bad.0.algorithm = .sarsa.: no registered advantage estimator"):
        load_params(path)


def test_summary_flags_a_better_arm_and_reports_render(tmp_path):
    rng = np.random.default_rng(0)
    init = (rng.random(120) < 0.3).astype(int).tolist()
    same = [init, init, init]
    better = [[1 if (x or rng.random() < 0.5) else 0 for x in init] for _ in range(3)]
    s = summarize({"grpo": same, "gigpo": better}, init, "grpo", "sft", 0.95)
    assert s["grpo"]["vs_sft"] == {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    assert s["gigpo"]["vs_grpo"]["ci_low"] > 0 and s["gigpo"]["vs_sft"]["diff"] > 0.2
    assert s["sft"]["ci_low"] < s["sft"]["success"] < s["sft"]["ci_high"]
    result = {"summary": s, "init": "sft", "baseline": "grpo", "confidence": 0.95, "seeds": [0, 1, 2], "panel": "test",
              "n_tasks": 120, "episode_budget": 64, "arms": {"grpo": [{"algorithm": "grpo"}], "gigpo": [{"algorithm": "gigpo"}]},
              "seconds": {"grpo": 60, "gigpo": 90},
              "curves": {a: [[{"episodes": 32, "success": 0.3}, {"episodes": 64, "success": 0.4}]] * 3 for a in ("grpo", "gigpo")}}
    write_ablation_reports(result, tmp_path)
    md = (tmp_path / "ablation.md").read_text()
    assert "| gigpo | algorithm=gigpo |" in md and "Best arm: **gigpo**" in md and "which beats `sft`" in md
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"


def test_an_arm_with_two_stages_trains_at_its_budget(tmp_path):
    from agentkiln.policy import save_policy
    from tests.conftest import scratch_policy
    from agentkiln.synthesis.generate import generate

    tasks = generate("gym-toytext", 4, seed=5, level="easy", out_dir=tmp_path / "tasks", game="frozenlake")
    save_policy(scratch_policy(tasks, tmp_path / "tasks"), tmp_path / "init")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["ablation"]["base"] = {"iterations": 100, "episode_budget": 8, "tasks_per_iter": 2, "group_size": 2}
    raw["ablation"]["arms"] = {"grpo": [{"algorithm": "grpo"}],
                               "scaling": [{"max_turns": 3, "episode_budget": 4}, {"max_turns": 6, "episode_budget": 4}]}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(path)
    _, curve = train_arm(params, "scaling", 0, tasks, tmp_path / "tasks", tmp_path / "init")
    assert [(c["stage"], c["episodes"]) for c in curve] == [(0, 4), (1, 8)]


def test_a_job_in_a_worker_process_equals_the_same_job_in_process(tmp_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from agentkiln.stages.ablation import run_job
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["ablation"]["base"] = {"iterations": 100, "episode_budget": 8, "tasks_per_iter": 2, "group_size": 2, "max_turns": 4}
    raw["ablation"]["arms"] = {"grpo": [{"algorithm": "gigpo"}]}
    raw["evaluate"]["max_turns"] = 4
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(path)
    import os

    import torch

    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)  # models/sft is found relative to the repository root, as in the flow
    try:
        here = run_job(params, "grpo", 1, tasks_dir, threads=1)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            there = ex.submit(run_job, params, "grpo", 1, tasks_dir, 1).result()
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    assert here[:2] == there[:2] and len(here[0]) == 3
