"""Promotion scores from the per-task outcomes it checks, never from metrics.json's aggregates: a
valid but tampered metrics.json (success 1.0 while the outcomes say 0/8) is refused by name and
nothing is registered. A real sealed panel, a real policy, a real MLflow SQLite store."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from agentkiln import tracking
from agentkiln.artifacts import ArtifactError
from agentkiln.panels import seal
from agentkiln.stats import wilson_interval
from agentkiln.policy import save_policy
from agentkiln.stages.promote import run_promote
from agentkiln.synthesis.generate import env_version, generate
from tests.conftest import params_with, scratch_policy, tiny_dataset
from tests.test_tracking_registry import _isolated_mlflow_env

N = 8
SFT, RANDOM, OOD, VAL = [1] * 6 + [0] * 2, [0] * N, [1, 0, 0, 0], [1, 1, 0]  # the outcomes evaluate "wrote"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A sealed 8-task FrozenLake test panel, an `sft` policy and an MLflow store of the module's own."""
    root = tmp_path_factory.mktemp("promote")
    tasks_dir = root / "data" / "tasks"
    tasks = generate("gym-toytext", N, seed=6, level="easy", out_dir=tasks_dir, game="frozenlake")
    (tasks_dir / "test").mkdir(parents=True)
    (tasks_dir / "test" / "manifest.json").write_text(json.dumps(seal(
        {"tasks": [dataclasses.asdict(t) for t in tasks], "env_versions": {"gym-toytext": env_version("gym-toytext")}})))
    save_policy(scratch_policy(tasks, tasks_dir), root / "models" / "sft")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with _isolated_mlflow_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        for var in ("MLFLOW_REGISTRY_URI", tracking.PARENT_ENV):
            os.environ.pop(var, None)
        mp.chdir(root)  # a user-set tracking URI keeps artifacts in ./mlruns: here, in root
        tracking._setup_state = None
        tracking.setup()
        yield {"root": root, "tasks_dir": tasks_dir, "ids": [t.task_id for t in tasks]}


def panel_metrics(won: list[int]) -> dict:
    """What evaluate writes for these outcomes (rounded to 4 places, as metrics.json is)."""
    lo, hi = wilson_interval(sum(won), len(won))
    return {"success": round(sum(won) / len(won), 4), "ci_low": round(lo, 4), "ci_high": round(hi, 4),
            "n_tasks": len(won), "mean_turns": 5.0, "invalid_rate": 0.0}


def write_reports(world, tmp_path, tamper=lambda metrics, outcomes: None):
    ids = world["ids"]
    outcomes = {"sft": {"test": dict(zip(ids, SFT)), "ood": {f"ood-{i}": x for i, x in enumerate(OOD)},
                        "val": {f"val-{i}": x for i, x in enumerate(VAL)}},
                "random": {"test": dict(zip(ids, RANDOM))}}
    metrics = {"sft": panel_metrics(SFT) | {"ood": panel_metrics(OOD), "val": panel_metrics(VAL)},
               "random": panel_metrics(RANDOM)}
    tamper(metrics, outcomes)
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "metrics.json").write_text(json.dumps(metrics, indent=2))
    panel = json.loads((world["tasks_dir"] / "test" / "manifest.json").read_text())["sha256"][:16]
    (reports / "outcomes.json").write_text(json.dumps({"panels": {"test": panel}, "outcomes": outcomes}))
    return reports


def promote(world, reports, model_name):
    params = params_with({"promote": {"model_name": model_name, "candidates": ["sft"]}})
    return run_promote(params, world["root"], world["tasks_dir"], reports, {"sft": world["root"] / "models" / "sft"})


def versions(model_name: str) -> list:
    from mlflow import MlflowClient

    return MlflowClient().search_model_versions(f"name='{model_name}'")


def test_consistent_reports_register_the_scores_of_the_outcomes(world, tmp_path):
    result = promote(world, write_reports(world, tmp_path), "agentkiln-consistent")
    (mv,) = versions("agentkiln-consistent")
    assert result["score"] == 0.75 and mv.tags["eval.success"] == "0.7500" and mv.tags["metric.success"] == "0.75"
    lo, hi = wilson_interval(6, N)
    assert (mv.tags["eval.ci_low"], mv.tags["eval.ci_high"]) == (f"{lo:.4f}", f"{hi:.4f}")
    assert mv.tags["eval.outcomes"] == "".join(str(x) for _, x in sorted(zip(world["ids"], SFT)))
    assert mv.tags["eval.ood_success"] == "0.2500"


def _set(policy, field, value):
    def tamper(metrics, outcomes):
        *path, last = field.split(".")
        entry = metrics[policy]
        for k in path:
            entry = entry[k]
        entry[last] = value
    return tamper


@pytest.mark.parametrize("policy,field,value,derived", [
    ("sft", "success", 1.0, "0.7500"),  # the candidate's score: the issue's case, below
    ("random", "success", 0.5, "0.0000"),  # the floor it must beat
    ("sft", "ood.success", 1.0, "0.2500"),  # a guard
    ("sft", "ci_low", 0.9, None),
    ("sft", "n_tasks", 80, "8"),
])
def test_a_metric_that_disagrees_with_the_outcomes_registers_nothing(world, tmp_path, policy, field, value, derived):
    name = f"agentkiln-tampered-{policy}-{field}"
    reports = write_reports(world, tmp_path, _set(policy, field, value))
    with pytest.raises(ArtifactError) as err:
        promote(world, reports, name)
    msg = str(err.value)
    assert msg.startswith(f"{reports / 'metrics.json'}: policy {policy}: {field} = {value}, but its per-task outcomes "
                          f"in outcomes.json give ")
    assert derived is None or f"give {derived}:" in msg
    assert "re-run `agentkiln stage evaluate`" in msg and "\n" not in msg
    assert versions(name) == []


def test_the_issues_case_success_one_with_outcomes_zero_of_eight(world, tmp_path):
    def tamper(metrics, outcomes):
        outcomes["sft"]["test"] = dict.fromkeys(world["ids"], 0)
        metrics["sft"]["success"] = 1.0
    with pytest.raises(ArtifactError, match=re.escape(f"{tmp_path / 'reports' / 'metrics.json'}: policy sft: success "
                                                      "= 1.0, but its per-task outcomes in outcomes.json give 0.0000")):
        promote(world, write_reports(world, tmp_path, tamper), "agentkiln-issue")
    assert versions("agentkiln-issue") == []


@pytest.mark.parametrize("case,tamper,what", [
    ("task", lambda m, o: o["sft"]["test"].popitem(),
     r"outcomes\.json: policy sft's test outcomes are not those of the panel's 8 tasks \(1 differ"),
    ("ood", lambda m, o: o["sft"].pop("ood"), r"metrics\.json: policy sft has ood scores but no per-task ood outcomes"),
    ("val", lambda m, o: o["sft"].pop("val"), r"metrics\.json: policy sft has val scores but no per-task val outcomes"),
    ("val-success", lambda m, o: m["sft"]["val"].update(success=1.0),
     r"metrics\.json: policy sft: val\.success = 1\.0, but its per-task outcomes in outcomes\.json give 0\.6667"),
    ("random", lambda m, o: o.pop("random"),
     r"metrics\.json: policy random has test scores but no per-task test outcomes"),
])
def test_outcomes_that_cannot_back_the_metrics_register_nothing(world, tmp_path, case, tamper, what):
    name = f"agentkiln-unbacked-{case}"
    with pytest.raises(ArtifactError, match=what + ".*re-run `agentkiln stage evaluate`"):
        promote(world, write_reports(world, tmp_path, tamper), name)
    assert versions(name) == []


def test_the_reports_evaluate_writes_pass_and_are_what_is_registered(world, tmp_path):
    """No false refusal: metrics.json and outcomes.json as the evaluate stage writes them (rounded
    figures, baselines, an ood and a val panel) agree, and the registered score is the one evaluate reported
    (the test panel's: val is reported and compared beside it, never promoted on)."""
    from agentkiln.panels import load_panel
    from agentkiln.stages.evaluate import run_evaluate

    lake = {"frozenlake_easy": 1.0}
    tasks_dir = tiny_dataset(tmp_path / "tasks", {"sft": lake, "rl": lake, "test": lake, "ood": {"frozenlake_medium": 1},
                                                  "val": lake}, n={"sft": 2, "rl": 2, "test": 6, "ood": 3, "val": 4})
    save_policy(scratch_policy(load_panel(tasks_dir, "sft"), tasks_dir), tmp_path / "sft")
    params = params_with({"evaluate": {"policies": ["random", "oracle", "sft"], "compare": [["sft", "random"]],
                                       "pass_k": {"samples": 2, "policies": ["sft"]}, "n_boot": 200},
                          "promote": {"model_name": "agentkiln-evaluated", "candidates": ["sft"], "floor": "none"}})
    reports = tmp_path / "reports"
    run_evaluate(params, tasks_dir, {"sft": tmp_path / "sft"}, reports)
    reported = json.loads((reports / "metrics.json").read_text())["sft"]
    result = run_promote(params, world["root"], tasks_dir, reports, {"sft": tmp_path / "sft"})
    (mv,) = versions("agentkiln-evaluated")
    assert result["score"] == pytest.approx(reported["success"], abs=5e-5)
    assert mv.tags["eval.success"] == f"{reported['success']:.4f}"
    assert mv.tags["eval.ood_success"] == f"{reported['ood']['success']:.4f}"
    # the val panel: played by every policy, compared like the others, in every report
    val_ids = {t.task_id for t in load_panel(tasks_dir, "val")}
    outcomes = json.loads((reports / "outcomes.json").read_text())
    assert all(set(o["val"]) == val_ids for o in outcomes["outcomes"].values()) and len(val_ids) == 4
    assert reported["val"]["n_tasks"] == 4 and reported["val"]["success"] == pytest.approx(
        sum(outcomes["outcomes"]["sft"]["val"].values()) / 4, abs=5e-5)
    rows = json.loads((reports / "comparisons.json").read_text())
    assert any(c["panel"] == "val" and (c["a"], c["b"]) == ("sft", "random") for c in rows)
    assert json.loads((reports / "headline.json").read_text())["oracle"]["val"] == 1.0
    assert "## Second draw (val panel" in (reports / "eval.md").read_text()
    assert "Second draw (val)" in (reports / "eval.html").read_text()
