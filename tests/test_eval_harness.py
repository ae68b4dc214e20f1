"""The evaluation harness: pass@k and paired comparisons by hand, baselines as floor and ceiling,
breakdowns and efficiency, identical numbers on a second run, and the one-command CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from agentkiln.evaluate.baselines import OracleAgent, RandomAgent
from agentkiln.evaluate.harness import pass_at_k_curve, panel_summary, play
from agentkiln.panels import seal
from agentkiln.stats import compare_paired, pass_at_k
from agentkiln.synthesis.generate import env_version, generate


# ------------------------------------------------------------------ pass@k by hand
@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 1 - 3 / 5),  # 1 - C(3,1)/C(5,1)
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a success
    (10, 0, 3, 0.0),
    (16, 16, 1, 1.0),
    (16, 1, 8, 1 - 6435 / 12870),  # 1 - C(15,8)/C(16,8) = 0.5
    (16, 4, 16, 1.0),
    (200, 37, 10, 1 - math.comb(163, 10) / math.comb(200, 10)),
])
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_success_rate_and_pass_at_k_grows_with_k():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    vals = [pass_at_k(16, 3, k) for k in range(1, 17)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))


@pytest.mark.parametrize("args", [(5, 6, 1), (5, 2, 0), (5, 2, 6), (0, 0, 1), (5, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)
    with pytest.raises(TypeError):
        pass_at_k(5.0, 2, 1)


def test_pass_at_k_curve_averages_tasks():
    recs = [{"task_id": "a", "won": w} for w in (1, 0, 0, 0)] + [{"task_id": "b", "won": 1} for _ in range(4)]
    curve = pass_at_k_curve(recs, [1, 2, 4])
    assert curve == pytest.approx({1: (0.25 + 1) / 2, 2: (0.5 + 1) / 2, 4: 1.0})  # a: 1 - C(3,2)/C(4,2) = 0.5
    with pytest.raises(ValueError, match="same number of samples"):
        pass_at_k_curve(recs[:-1], [1])


# ------------------------------------------------------------------ paired comparison
def test_paired_comparison_flags_a_better_policy_and_never_a_policy_against_itself():
    worse = [1] * 30 + [0] * 70
    better = [1] * 30 + [1] * 30 + [0] * 40  # wins all the other's tasks and 30 more
    c = compare_paired(better, worse)
    assert c["significant"] and c["better"] == "a" and c["diff"] == pytest.approx(0.30) and c["ci_low"] > 0.15
    assert compare_paired(worse, better)["better"] == "b"
    same = compare_paired(better, better)
    assert not same["significant"] and same["better"] is None and (same["diff"], same["ci_low"], same["ci_high"]) == (0, 0, 0)
    noisy = compare_paired([1, 0] * 50, [0, 1] * 50)  # same rate, different tasks: no verdict
    assert not noisy["significant"] and noisy["ci_low"] < 0 < noisy["ci_high"]


def test_comparisons_split_each_panel_by_family_so_a_regressed_family_shows():
    """A policy better over the whole panel but worse on one of its families: the whole-panel row says
    better, the family row says worse, and the regression line names that family."""
    from types import SimpleNamespace

    from agentkiln.config import EvaluateParams
    from agentkiln.evaluate.report import family_comparison_table, regression_line, regressions
    from agentkiln.stages.evaluate import paired_comparisons

    task = lambda i, fam: SimpleNamespace(task_id=f"{fam}-{i}", family=fam)  # noqa: E731
    panel = [task(i, "lake") for i in range(60)] + [task(i, "words") for i in range(20)]
    ood = [task(i, "lake") for i in range(10)]
    # rl wins 50 more lakes than sft and loses 12 of the 14 word problems sft won
    sft = {**{f"lake-{i}": int(i < 5) for i in range(60)}, **{f"words-{i}": int(i < 14) for i in range(20)}}
    rl = {**{f"lake-{i}": int(i < 55) for i in range(60)}, **{f"words-{i}": int(i < 2) for i in range(20)}}
    ood_out = {f"lake-{i}": 0 for i in range(10)}
    per_task = {"sft": {"test": sft, "ood": ood_out}, "rl": {"test": rl, "ood": ood_out}}
    p = EvaluateParams(policies=["sft", "rl"], compare=[("rl", "sft")], n_boot=500)
    got = paired_comparisons(p, per_task, {}, {"test": panel, "ood": ood})
    rows = {(c["panel"], c["family"]): c for c in got}
    assert set(rows) == {("test", None), ("test", "lake"), ("test", "words"), ("ood", None)}  # ood: one family, no split
    assert rows["test", None]["better"] == "a" and rows["test", None]["diff"] == pytest.approx((50 - 12) / 80)
    assert rows["test", "lake"]["n_tasks"] == 60 and rows["test", "lake"]["diff"] == pytest.approx(50 / 60)
    assert rows["test", "words"]["better"] == "b" and rows["test", "words"]["diff"] == pytest.approx(-12 / 20)
    assert rows["ood", None]["diff"] == 0 and rows["ood", None]["better"] is None
    assert regressions(got) == [f"rl below sft on test/words (greedy): -60.0 [{100 * rows['test', 'words']['ci_low']:+.1f}, "
                                f"{100 * rows['test', 'words']['ci_high']:+.1f}]"]
    assert "test/words" in regression_line(got) and "| rl vs sft | test | words | 20 | -60.0 |" in family_comparison_table(got)
    same = paired_comparisons(p, {"sft": per_task["sft"], "rl": per_task["sft"]}, {}, {"test": panel, "ood": ood})
    assert regressions(same) == [] and regression_line(same).startswith("No comparison")


# ------------------------------------------------------------------ playing a panel
@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    """A sealed test panel of FrozenLake and Sokoban tasks."""
    out = tmp_path_factory.mktemp("panel")
    tasks = generate("gym-toytext", 6, seed=11, level="easy", out_dir=out, game="frozenlake")
    tasks += generate("sokoban", 4, seed=12, level="easy", out_dir=out)
    (out / "test").mkdir()
    manifest = {"split": "test", "seed": 0, "n_tasks": len(tasks), "tasks": [dataclasses.asdict(t) for t in tasks],
                "env_versions": {f: env_version(f) for f in ("gym-toytext", "sokoban")}}
    (out / "test" / "manifest.json").write_text(json.dumps(seal(manifest)))
    return tasks, out


def test_oracle_is_the_ceiling_and_random_the_floor(panel):
    tasks, out = panel
    levels = {t.task_type: "easy" for t in tasks}
    oracle = panel_summary(play(OracleAgent(), tasks, out, None, levels=levels), 0.95)
    rand = panel_summary(play(RandomAgent(seed=0), tasks, out, None, levels=levels), 0.95)
    assert oracle["success"] == 1.0 and oracle["invalid_rate"] == 0.0
    assert oracle["mean_turns"] == pytest.approx(sum(t.expert_steps for t in tasks) / len(tasks))
    assert rand["success"] < oracle["success"]
    assert set(oracle["by_family"]) == {"gym-toytext", "sokoban"} and set(oracle["by_level"]) == {"easy"}
    assert oracle["by_family"]["sokoban"]["n_tasks"] == 4
    assert oracle["tokens_per_episode"] == 0.0 and oracle["tool_calls_per_episode"] == 0.0


def test_a_panel_played_twice_gives_identical_numbers(panel):
    from tests.conftest import scratch_policy
    from agentkiln.rollout.agents import PolicyAgent

    tasks, out = panel
    pol = scratch_policy(tasks, out)
    runs = [play(PolicyAgent(pol, greedy=True), tasks, out, 6) for _ in range(2)]
    assert runs[0] == runs[1]
    sampled = [play(PolicyAgent(pol, temperature=1.0, seed=3), tasks, out, 6, samples=4) for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 4 * len(tasks)
    s = panel_summary(runs[0])
    assert s["tokens_per_episode"] > 0 and 0 <= s["success"] <= 1


def test_tool_calls_are_counted_for_free_form_families(tmp_path):
    tasks = generate("search-qa", 3, seed=5, level="easy", out_dir=tmp_path)
    recs = play(OracleAgent(), tasks, tmp_path, None)
    assert all(r["won"] for r in recs)
    # the oracle searches for every hop, then answers: all its steps but the last are tool calls
    assert [r["tool_calls"] for r in recs] == [t.expert_steps - 1 for t in tasks]


# ------------------------------------------------------------------ one command
def test_cli_evaluates_baselines_with_a_paired_comparison(panel, tmp_path, capsys):
    from agentkiln.evaluate.__main__ import main

    _, out = panel
    assert main(["--model", "random", "--model", "oracle", "--tasks", str(out), "--out", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "| oracle | 100.0%" in text and "oracle vs random" in text
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["metrics"]["oracle"]["success"] == 1.0 and res["comparisons"][0]["a"] == "oracle"
    assert len(res["outcomes"]["random"]) == 10 and res["panel_id"] == json.loads((out / "test" / "manifest.json").read_text())["sha256"][:16]


def test_cli_compares_sampled_play_per_task(panel, tmp_path, capsys):
    """With --samples, each pair is also compared on per-task success rates over the samples."""
    import shutil

    from agentkiln.evaluate.__main__ import main
    from agentkiln.policy import save_policy
    from tests.conftest import scratch_policy

    tasks, out = panel
    save_policy(scratch_policy(tasks, out), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same weights under another name
    args = ["--model", str(tmp_path / "a"), "--model", str(tmp_path / "b"), "--samples", "3", "--tasks", str(out)]
    assert main([*args, "--out", str(tmp_path / "r.json")]) == 0
    assert "| sampled T=1 x3 |" in capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    greedy, sampled = res["comparisons"]
    assert greedy["decoding"] == "greedy" and sampled["decoding"] == "sampled T=1 x3"
    # same weights, same sampling seed: identical samples, so a zero difference with a zero-width CI
    assert (sampled["diff"], sampled["ci_low"], sampled["ci_high"], sampled["significant"]) == (0, 0, 0, False)


def test_cli_refuses_a_tampered_panel_and_an_unknown_model(panel, tmp_path, capsys):
    import shutil

    from agentkiln.evaluate.__main__ import main

    _, out = panel
    shutil.copytree(out, tmp_path / "t")
    m = json.loads((tmp_path / "t" / "test" / "manifest.json").read_text())
    m["tasks"][0]["seed"] += 1
    (tmp_path / "t" / "test" / "manifest.json").write_text(json.dumps(m))
    assert main(["--model", "random", "--tasks", str(tmp_path / "t")]) == 2
    assert "modified after it was frozen" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nothing-here"), "--tasks", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing-here: no such file or directory; a model is random or oracle" in err and "models:/" in err
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), "--tasks", str(out)]) == 2
    assert "empty: holds neither config.json nor state.pt" in capsys.readouterr().err


def test_success_rates_are_per_task_means_over_samples():
    from agentkiln.evaluate.harness import success_rates

    recs = [{"task_id": "a", "won": True}, {"task_id": "a", "won": False}, {"task_id": "a", "won": False},
            {"task_id": "b", "won": True}, {"task_id": "b", "won": True}, {"task_id": "b", "won": False}]
    rates = success_rates(recs)
    assert list(rates) == ["a", "b"] and rates["a"] == pytest.approx(1 / 3) and rates["b"] == pytest.approx(2 / 3)
