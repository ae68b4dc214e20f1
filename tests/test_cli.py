"""The `agentkiln` console script: every command answers --help and touches nothing; usage errors
(an unknown override key, a stage name, an empty registry, a missing model) are one line naming the
problem and what to do, exit status 2 (1 for an empty registry), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkiln.cli import app
from tests.conftest import copy_worktree

COMMANDS = [["run"], ["stage"], ["eval"], ["play"], ["findings"], ["promote"], ["rollback"], ["registry"], ["registry", "show"],
            ["serve"], ["ui"], ["endpoint"], ["collect"], ["doctor"]]
SCRIPT = Path(sys.executable).parent / "agentkiln"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("cli") / "repo")


def tree(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if "__pycache__" not in p.parts}


def invoke(repo: Path, *args: str):
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        os.chdir(cwd)


def test_every_command_answers_help_without_side_effects(repo):
    before = tree(repo)
    res = subprocess.run([str(SCRIPT), "--help"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Commands" in res.stdout, res.stderr
    for cmd in [c for c in COMMANDS if c != ["stage"]]:  # the real console script, for a sample of them
        if cmd in (["run"], ["registry", "show"], ["doctor"]):
            res = subprocess.run([str(SCRIPT), *cmd, "--help"], cwd=repo, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0 and "Usage" in res.stdout, (cmd, res.stderr)
    for cmd in COMMANDS:
        res = invoke(repo, *cmd, "--help")
        assert res.exit_code == 0, (cmd, res.output)
        assert "usage" in res.output.lower(), (cmd, res.output)
    created = tree(repo) - before
    assert not created, f"--help wrote {sorted(map(str, created))}"
    assert not (repo / "mlflow.db").exists() and not (repo / "mlruns").exists()


def test_overrides_are_checked_before_anything_runs(repo):
    res = invoke(repo, "run", "-S", "sft.epoch=2")
    assert res.exit_code == 2 and "sft.epoch" in res.output and "epochs" in res.output, res.output
    res = invoke(repo, "run", "-S", "sft.epochs=many")
    assert res.exit_code == 2 and "sft.epochs" in res.output, res.output
    res = invoke(repo, "run", "-S", "seed")
    assert res.exit_code == 2 and "key=value" in res.output, res.output


def test_unknown_stage_lists_the_stages(repo):
    res = invoke(repo, "stage", "nope")
    assert res.exit_code == 2
    assert "no stage 'nope'" in res.output and "rl@main" in res.output and "evaluate" in res.output


def test_registry_show_on_an_empty_project_creates_no_store(repo, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    res = invoke(repo, "registry", "show")
    assert res.exit_code == 1 and "run the pipeline first" in res.output
    assert not (repo / "mlflow.db").exists()


def test_doctor_reports_each_check(repo):
    res = invoke(repo, "doctor")
    names = {line.split("]")[1].split(":")[0].strip() for line in res.output.splitlines() if line.startswith("[")}
    assert {"python", "packages", "sandbox", "project", "params", "mlflow", "prefect"} <= names, res.output
    assert "[FAIL] project" in res.output and res.exit_code == 1  # the copy is not a git repository
    assert not (repo / "mlflow.db").exists()


def test_play_shows_every_turn_of_an_episode(repo):
    res = invoke(repo, "play", "--model", "oracle", "--family", "gym-toytext", "--seed", "2")
    assert res.exit_code == 0, res.output
    turns = res.output.count("--- turn ")
    assert turns >= 1 and res.output.count(">>> ") == turns and f"WON in {turns} turns" in res.output
    res = invoke(repo, "play", "--family", "chess")
    assert res.exit_code == 2 and "families:" in res.output


@pytest.mark.parametrize("argv, expect", [
    (["flows.rl", "--stage", "nope"], "no RL stage 'nope'"),
    (["flows.distill"], "models/rl/main is missing: the rl@main stage writes it"),
])
def test_flow_usage_errors_are_one_line_not_a_traceback(repo, argv, expect):
    res = subprocess.run([sys.executable, "-m", *argv], cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and expect in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not (repo / "mlflow.db").exists()
