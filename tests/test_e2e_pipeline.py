"""The real DAG end to end: a temporary git repo, tiny params, `python -m flows.pipeline`
(dvc repro + promotion), then DVC caching, determinism and the MLflow store are checked."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentkiln.registry import ui
from tests.conftest import copy_worktree
from tests.team_services import postgres_available, postgres_cluster

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

TINY = {
    "synthesize": {
        "workers": 2,
        "splits": {
            # a mixture with tool families (free-form replies, tools run in the sandbox) next to text games
            "sft": {"n_tasks": 8, "seed": 11, "mix": {"coin_easy": 1.0, "frozenlake_easy": 1.0, "sokoban_easy": 1.0,
                                                     "sql_easy": 1.0, "python_easy": 1.0, "searchqa_easy": 1.0}},
            "rl": {"n_tasks": 4, "seed": 12, "mix": {"coin_easy": 1.0, "frozenlake_easy": 1.0, "python_easy": 1.0}},
            "test": {"n_tasks": 6, "seed": 13, "mix": {"coin_easy": 1.0, "frozenlake_easy": 1.0, "sql_easy": 1.0}},
            "ood": {"n_tasks": 2, "seed": 14, "mix": {"sokoban_medium": 1.0}},
            "val": {"n_tasks": 2, "seed": 15, "mix": {"frozenlake_easy": 1.0, "sql_easy": 1.0}},
        },
    },
    "sft": {"epochs": 2, "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                                   "vocab_size": 512}},
    # two chained RL stages (a growing horizon, as ScalingInter-RL), the second with another algorithm
    "rl": {"defaults": {"iterations": 2, "tasks_per_iter": 2, "group_size": 2, "max_turns": 6},
           "stages": {"h3": {"init": "sft", "max_turns": 3}, "h6": {"init": "rl/h3", "algorithm": "gigpo"}}},
    "distill": {"epochs": 1, "samples_per_task": 1, "max_turns": 6,
                "student": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}},
    "evaluate": {"max_turns": 6, "pass_k": {"samples": 2, "policies": ["sft", "rl"]}},
    # models this tiny do not beat random on 6 tasks: no floor, so the registry path (champion) is exercised
    "promote": {"floor": "none"},
}


def merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = merge(base.get(k, {}), v) if isinstance(v, dict) and k not in ("mix", "stages") else v
    return base


def sh(args, cwd, env):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Where the e2e pipeline tracks: a team's MLflow server on PostgreSQL with a shared artifact
    root when PostgreSQL can run here (CI installs it: scripts/install_postgres.sh), else the
    laptop default, a SQLite file. Yields (MLFLOW_TRACKING_URI, kind)."""
    why = postgres_available()
    if why is not None:
        yield None, f"sqlite ({why})"
        return
    with postgres_cluster() as db, ui.start_server(db, tmp_path_factory.mktemp("shared_artifacts")) as server:
        yield server, "postgresql"


@pytest.fixture(scope="module")
def repo(tmp_path_factory, store):
    """The tiny pipeline run once, as a team member runs it: tracked on `store`, its data and models
    pushed to a DVC directory remote and its dvc.lock committed (what `git push` would share)."""
    dst = tmp_path_factory.mktemp("e2e") / "agentkiln"
    copy_worktree(dst)
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["MLFLOW_TRACKING_URI"] = store[0] or f"sqlite:///{dst / 'mlflow.db'}"
    env.pop("AGENTKILN_PARENT_RUN_ID", None)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    sh(["git", "init", "-q"], dst, env)
    sh([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", str(tmp_path_factory.mktemp("dvc_remote"))], dst, env)
    sh([*git, "add", "-A"], dst, env)
    sh([*git, "commit", "-qm", "snapshot"], dst, env)
    (dst.parent / "pipeline.log").write_text(sh([sys.executable, "-m", "flows.pipeline"], dst, env))
    sh([sys.executable, "-m", "dvc", "push"], dst, env)
    sh([*git, "add", "dvc.lock"], dst, env)
    sh([*git, "commit", "-qm", "pipeline run"], dst, env)
    return dst, env, (dst / "reports/metrics.json").read_bytes()  # metrics of the first, original-params run


def test_a_fresh_clone_pulls_what_the_run_pushed_and_repro_runs_nothing(repo, tmp_path):
    """A teammate's machine: git clone, dvc pull from the team's remote, and the pipeline is up to
    date: every stage's outputs arrive with the hashes the run recorded; dvc repro runs nothing."""
    dst, env, first = repo
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(dst), str(clone)], tmp_path, env)
    assert not (clone / "models/sft").exists() and not (clone / "data/tasks").exists()
    out = sh([sys.executable, "-m", "dvc", "pull"], clone, env)
    assert "fetched" in out.lower() or "added" in out.lower(), out
    assert (clone / "reports/metrics.json").read_bytes() == first
    assert (clone / "models/sft/config.json").is_file() and (clone / "data/tasks/test/manifest.json").is_file()
    status = sh([sys.executable, "-m", "dvc", "status"], clone, env)
    assert "up to date" in status, status
    out = sh([sys.executable, "-m", "dvc", "repro"], clone, env)
    assert "Running stage" not in out, out


def test_a_run_ends_saying_what_it_produced_and_the_pipeline_run_has_its_numbers(repo):
    """The run's last lines: each stage's headline, the promotion, what to open; the parent MLflow run
    "pipeline" carries the panels' success per policy (two pipelines compare at the top level)."""
    from mlflow import MlflowClient

    dst, env, _ = repo
    out = (dst.parent / "pipeline.log").read_text()
    tail = out[out.index("agentkiln: the pipeline finished. What it produced:"):]
    for line in ("  sft       models/sft:", "  rl        models/rl/h6: gigpo,", "  distill   models/distilled:",
                 "  evaluate  test panel: random", "  promote   ", "Open next: reports/eval.html"):
        assert line in tail, tail
    metrics = json.loads((dst / "reports/metrics.json").read_text())
    uri = env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri, uri)
    runs = client.search_runs([client.get_experiment_by_name("agentkiln").experiment_id],
                              "attributes.run_name = 'pipeline'")
    logged = runs[0].data.metrics
    assert logged["sft/test"] == pytest.approx(metrics["sft"]["success"])
    assert logged["rl/ood"] == pytest.approx(metrics["rl"]["ood"]["success"])
    assert logged["rl/val"] == pytest.approx(metrics["rl"]["val"]["success"])
    assert {f"rl/test_{f}" for f in metrics["rl"]["by_family"]} <= set(logged)
    assert "promote/promoted" in logged
    # `dvc metrics show`: success per policy on the two panels (metrics.json's breakdowns had made ~600 columns)
    shown = sh([sys.executable, "-m", "dvc", "metrics", "show", "reports/headline.json"], dst, env)
    assert "rl.test" in shown and "rl.ood" in shown and max(len(line) for line in shown.splitlines()) < 250, shown


def test_the_store_is_the_team_server_when_postgresql_runs_here(repo, store):
    """CI runs the pipeline against MLflow on PostgreSQL; without PostgreSQL this says why."""
    if store[1] != "postgresql":
        pytest.skip(store[1])
    from mlflow import MlflowClient

    client = MlflowClient(store[0], store[0])
    runs = client.search_runs([client.get_experiment_by_name("agentkiln").experiment_id])
    assert {"pipeline", "sft", "evaluate", "promote"} <= {r.info.run_name for r in runs}
    assert client.get_registered_model("agentkiln-policy").latest_versions


def test_mlflow_ui_shows_training_runs_models_inputs_and_lineage(repo, store, tmp_path):
    """The MLflow UI on the run's store: the experiment in the training view, the sft run with its
    logged model and dataset inputs, the registered version naming its training run (REST API).
    AGENTKILN_SAVE_SCREENSHOT=1 also takes the docs' screenshots with Chromium (docs/images/)."""
    from mlflow import MlflowClient

    dst, env, _ = repo
    uri = env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri, uri)
    exp = client.get_experiment_by_name("agentkiln")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    sft = next(r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "sft")
    assert [i.dataset.name for i in sft.inputs.dataset_inputs] == ["tasks/sft"]
    assert client.search_logged_models([exp.experiment_id], filter_string=f"source_run_id = '{sft.info.run_id}'")
    version = client.get_model_version_by_alias("agentkiln-policy", "challenger")
    trained_by = client.get_run(version.run_id)
    assert trained_by.info.run_name in {"sft", "rl-h6", "distill"} and version.tags["model_source"] == "training run"
    assert trained_by.info.run_id in version.description and "git commit" in version.description
    if not os.environ.get("AGENTKILN_SAVE_SCREENSHOT"):
        return  # the UI's rendering is checked in tests/test_mlflow_server.py; pictures on demand (CI time)
    with contextlib.ExitStack() as stack:
        base = uri if uri.startswith("http") else stack.enter_context(ui.start_server(uri, dst / "mlartifacts"))
        # ?workflowType=machine_learning: MLflow 3.17's UI picks GenAI / Model training per browser (GenAI by
        # default); sorted by run name, the runs list is flat (every stage run, its datasets and models)
        ml = "?workflowType=machine_learning"
        by_name = "&orderByKey=tags.%60mlflow.runName%60&orderByAsc=true"
        pages = {"mlflow_experiment.png": (f"{base}/#/experiments/{exp.experiment_id}/runs{ml}{by_name}", 700),
                 "mlflow_training_run.png": (f"{base}/#/experiments/{exp.experiment_id}/runs/{trained_by.info.run_id}{ml}", 1800),
                 "mlflow_model_version.png": (ui.model_url(base, version=version.version) + ml, 1100)}
        for name, (url, height) in pages.items():
            png = ui.screenshot(url, tmp_path / name, width=1500, height=height)
            assert png.stat().st_size > 30_000
            shutil.copyfile(png, ROOT / "docs" / "images" / name)


# written by the pipeline and not DVC outputs, on purpose: promotion's decision (the promote flow runs after
# `dvc repro`, against the registry), and Great Expectations' data docs (HTML whose file names and pages carry
# the validation's time: as an output they would change dvc.lock on every identical run)
NOT_STAGE_OUTPUTS = ("reports/promotion.json", "reports/data_docs/")


def test_every_file_the_stages_write_is_a_declared_output_and_every_output_exists(repo):
    """dvc.yaml, the flows and the stages agree on where outputs go: a file a stage writes that dvc.yaml
    does not declare would be neither versioned nor cached (and a rerun would not restore it); a declared
    output nobody writes fails `dvc repro`. Checked on the files the pipeline left under data/, models/
    and reports/ against every stage's outs in dvc.lock."""
    from agentkiln.cli import dvc_stages

    dst, _, _ = repo
    lock = yaml.safe_load((dst / "dvc.lock").read_text())["stages"]
    # the stages of this dvc.yaml and params (dvc.lock may keep entries of foreach items that no longer exist)
    declared = [o["path"].rstrip("/") for name in dvc_stages(dst) for o in lock[name].get("outs", [])]
    for path in declared:
        assert (dst / path).exists(), f"dvc.yaml declares {path}, which the pipeline did not write"
    tracked = set(subprocess.run(["git", "ls-files"], cwd=dst, capture_output=True, text=True, check=True).stdout.split())
    written = [f.relative_to(dst).as_posix() for top in ("data", "models", "reports") for f in (dst / top).rglob("*")
               if f.is_file() and f.name != ".gitignore"]  # DVC's own, beside the outputs
    stray = [f for f in written if f not in tracked and not f.startswith(NOT_STAGE_OUTPUTS)
             and not any(f == d or f.startswith(d + "/") for d in declared)]
    assert not stray, f"written by the pipeline but no stage's output in dvc.yaml: {stray}"


def test_pipeline_writes_metrics_for_every_policy(repo):
    dst, _, _ = repo
    metrics = json.loads((dst / "reports/metrics.json").read_text())
    assert set(metrics) == {"random", "oracle", "sft", "rl", "distilled"}
    assert metrics["oracle"]["success"] >= max(m["success"] for m in metrics.values())  # the ceiling
    assert set(metrics["rl"]["pass_at_k"]) == {"1", "2"} and metrics["rl"]["pass_at_k"]["1"] <= metrics["rl"]["pass_at_k"]["2"]
    comparisons = json.loads((dst / "reports/comparisons.json").read_text())
    pairs = [("sft", "random"), ("rl", "sft"), ("rl", "random"), ("distilled", "rl"), ("distilled", "sft"),
             ("distilled", "random")]
    greedy = [c for c in comparisons if c["decoding"] == "greedy"]
    for panel, n in (("test", 6), ("val", 2), ("ood", 2)):
        whole = [c for c in greedy if c["panel"] == panel and c["family"] is None]
        assert [(c["a"], c["b"]) for c in whole] == pairs and {c["n_tasks"] for c in whole} == {n}
    # within each family of a panel that has several (the ood panel here has one: no split)
    by_family = [c for c in greedy if c["family"] is not None]
    assert {(c["panel"], c["family"]) for c in by_family} == {("test", f) for f in ("textworld", "gym-toytext", "sql")} | {
        ("val", f) for f in ("gym-toytext", "sql")}
    assert sum(c["n_tasks"] for c in by_family if (c["a"], c["b"]) == ("rl", "sft") and c["panel"] == "test") == 6
    # sampled comparisons only where both policies have pass@k samples
    sampled = [(c["a"], c["b"]) for c in comparisons if c["decoding"] != "greedy"]
    with_samples = {p for p in metrics if "pass_at_k" in metrics[p]}
    assert sampled == [(a, b) for a, b in pairs if a in with_samples and b in with_samples]
    outcomes = json.loads((dst / "reports/outcomes.json").read_text())
    assert all(len(outcomes["outcomes"][p]["test"]) == 6 for p in metrics)
    for m in metrics.values():
        assert 0 <= m["ci_low"] <= m["success"] <= m["ci_high"] <= 1
        assert m["n_tasks"] == 6 and m["ood"]["n_tasks"] == 2 and m["val"]["n_tasks"] == 2
        # per family: the panel's three families, counts adding up to the panel
        assert set(m["by_family"]) == {"textworld", "gym-toytext", "sql"} and set(m["ood"]["by_family"]) == {"sokoban"}
        assert sum(f["n_tasks"] for f in m["by_family"].values()) == 6
        won = sum(round(f["success"] * f["n_tasks"]) for f in m["by_family"].values())
        assert won == round(m["success"] * 6)
    for policy in ("sft", "rl", "distilled"):  # the sql tasks were played with free-form replies and the tool
        assert metrics[policy]["by_family"]["sql"]["tokens_per_episode"] > 0
    assert metrics["distilled"]["n_params"] < metrics["rl"]["n_params"]
    for f in ("eval.md", "eval.html", "success.png", "passk.png", "curves.png", "passk.csv", "success.csv", "rl/h3/curve.csv", "rl/h6/curve.csv", "promotion.json", "data_docs/index.html"):
        assert (dst / "reports" / f).is_file(), f
    # each RL stage looked at val (2 tasks) at its start and end, and says which weights it saved: those of a look
    # whose success on each family was no lower than the start's (trainers.select)
    for stage in ("h3", "h6"):
        rl = json.loads((dst / f"reports/rl/{stage}/metrics.json").read_text())
        looks = {look.pop("iteration"): look for look in rl["select_looks"]}
        assert rl["select_panel"] == "val" and sorted(looks) == [0, 2] and rl["selected_iteration"] in looks
        kept = looks[rl["selected_iteration"]]
        assert all(kept[f] >= s for f, s in looks[0].items()) and kept["all"] == rl["select_success_selected"]
    manifests = [json.loads((dst / f"data/tasks/{s}/manifest.json").read_text()) for s in ("sft", "rl", "test", "ood", "val")]
    ids = [t["task_id"] for m in manifests for t in m["tasks"]]
    assert len(ids) == len(set(ids)) == 22


def test_mlflow_holds_pipeline_run_children_and_champion(repo):
    dst, env, _ = repo
    from mlflow import MlflowClient

    # a client of the run's store, not mlflow.set_tracking_uri: that would point this whole test process
    # at a server the store fixture stops after this module
    client = MlflowClient(env["MLFLOW_TRACKING_URI"], env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("agentkiln").experiment_id], max_results=1000)
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 1
    children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert {"synthesize", "sft", "rl-h3", "rl-h6", "distill", "evaluate", "promote"} <= children
    champion = client.get_model_version_by_alias("agentkiln-policy", "champion")
    assert champion.tags["lineage.params_hash"]
    assert any(k.startswith("lineage.data.") for k in champion.tags)
    panel = json.loads((dst / "data/tasks/test/manifest.json").read_text())["sha256"][:16]
    assert champion.tags["eval.panel"] == panel and len(champion.tags["eval.outcomes"]) == 6
    assert champion.tags["stage"] in {"sft", "rl@h6", "distill"} and champion.tags["lineage.git_commit"]


def test_second_repro_runs_nothing_and_evaluate_param_reruns_only_evaluate(repo):
    dst, env, _ = repo
    out = sh([sys.executable, "-m", "dvc", "repro"], dst, env)
    assert "Running stage" not in out
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["evaluate"]["seed"] = 1
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh([sys.executable, "-m", "dvc", "repro"], dst, env)
    assert "Running stage 'evaluate'" in out
    for stage in ("synthesize'", "sft'", "rl@", "distill'"):
        assert f"Running stage '{stage}" not in out


def test_editing_code_marks_exactly_the_stages_that_run_it_stale(repo):
    """`dvc status` after a one-line edit of a module: stale are the stages whose deps cover it."""
    dst, env, _ = repo
    dvc = yaml.safe_load((dst / "dvc.yaml").read_text())["stages"]

    def runs(stage: str, path: str) -> bool:
        deps = dvc[stage].get("do", dvc[stage])["deps"]
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)

    for path in ("src/agentkiln/trainers/distill.py", "src/agentkiln/sandbox/server.py", "src/agentkiln/policy/model.py",
                 "src/agentkiln/synthesis/sql.py"):
        original = (dst / path).read_bytes()
        (dst / path).write_bytes(original + b"\n# an edit\n")
        try:
            out = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=dst, env=env,
                                 capture_output=True, text=True, check=True).stdout
        finally:
            (dst / path).write_bytes(original)
        stale = {name.split("@")[0] for name, changes in json.loads(out).items()  # a dep may be a directory
                 if any(isinstance(c, dict) and any(path == d or path.startswith(d.rstrip("/") + "/")
                                                    for d in c.get("changed deps", {})) for c in changes)}
        assert stale == {s for s in dvc if runs(s, path)}, path
        assert stale, path


def test_rerun_from_scratch_gives_identical_metrics(repo):
    """Back to the original params, the metrics are the first run's bytes; then every stage that the
    SIGKILL tests below do not re-run from scratch (they re-run sft, rl@h6 and distill, and compare
    their outputs) runs again from scratch, with the very same outputs and metrics."""
    dst, env, first = repo
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["evaluate"]["seed"] = 0
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh([sys.executable, "-m", "dvc", "repro"], dst, env)  # back to the original params
    assert (dst / "reports/metrics.json").read_bytes() == first
    stages = ["synthesize", "rl@h3", "evaluate"]

    def outs() -> dict:
        lock = yaml.safe_load((dst / "dvc.lock").read_text())["stages"]
        return {s: {o["path"]: o["md5"] for o in lock[s]["outs"]} for s in stages}

    want, page = outs(), (dst / "reports/eval.html").read_text()
    out = sh([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", *stages], dst, env)
    for stage in stages:
        assert f"Running stage '{stage}'" in out
    # the tasks, rl@h3's weights and every report, byte for byte; but eval.html, which records the commit
    # it was made at: DVC's run cache restored the first run's page (made at the commit before dvc.lock's)
    got = outs()
    got["evaluate"].pop("reports/eval.html"), want["evaluate"].pop("reports/eval.html")
    assert got == want
    sha = re.compile(r"commit <code>[0-9a-f]{40}</code> &middot; commit date <code>[^<]*</code>")
    assert sha.sub("", (dst / "reports/eval.html").read_text()) == sha.sub("", page)
    assert (dst / "reports/metrics.json").read_bytes() == first


# the two training loops (supervised, RL) under DVC; distillation runs the supervised loop and its
# two phases' resume is checked without DVC (tests/test_kill_resume.py), which keeps CI within 25 min
@pytest.mark.parametrize("stage, ckpt, resumed", [
    ("sft", "models/checkpoints/sft", "resumed"),
    ("rl@h6", "models/checkpoints/rl/h6", "resumed from models/checkpoints/rl/h6 after iteration 1"),
])
def test_sigkilled_stage_resumes_under_dvc_with_identical_results(repo, stage, ckpt, resumed):
    """`dvc repro` of one training stage is SIGKILLed (its whole process group: DVC, the stage, its
    Prefect server) right after the stage's first checkpoint; `dvc repro` again resumes from it and
    ends with the very same outputs."""
    dst, env, _ = repo
    lock = yaml.safe_load((dst / "dvc.lock").read_text())
    want = {o["path"]: o["md5"] for o in lock["stages"][stage]["outs"]}
    # --force: as on a first run (this stage ran before, so DVC would simply restore its cached result)
    cmd = [sys.executable, "-m", "dvc", "repro", "--force", "--single-item", stage]
    run = subprocess.Popen(cmd, cwd=dst, env=env | {"AGENTKILN_PAUSE_AFTER_CHECKPOINT": "60"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not any((dst / ckpt).rglob("state.pt")):  # written, then the stage pauses: the kill lands here
        assert run.poll() is None and time.monotonic() < deadline, f"{stage} ended before its first checkpoint"
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert any((dst / ckpt).rglob("state.pt"))
    out = sh(cmd, dst, env)
    assert resumed in out, out[-2000:]
    lock = yaml.safe_load((dst / "dvc.lock").read_text())
    assert {o["path"]: o["md5"] for o in lock["stages"][stage]["outs"]} == want  # same weights and metrics
    assert not (dst / ckpt).exists()  # removed once the stage finished
