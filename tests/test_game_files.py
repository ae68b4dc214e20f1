"""TextWorld's compiled games are sealed data: each game file's sha256 is in its task's entry of the
sealed split manifest, and a truncated or altered game is refused by name (file, task, manifest, what
to run) when the split is loaded and when a game starts, never played or left to crash the interpreter.

One tiny split synthesized by the real code; each test damages its own copy."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from agentkiln.artifacts import ArtifactError
from agentkiln.envs import make
from agentkiln.panels import load_panel, manifest_path
from agentkiln.synthesis.generate import play_expert
from tests.conftest import params_with, tiny_dataset


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    mix = {"coin_easy": 1}
    return tiny_dataset(tmp_path_factory.mktemp("tasks"), {"sft": mix, "rl": mix, "test": mix},
                        n={"sft": 1, "rl": 2, "test": 2})


@pytest.fixture
def tasks_dir(sealed, tmp_path):
    return shutil.copytree(sealed, tmp_path / "tasks")


def refusal(path, task_id, manifest) -> str:
    """The refusal's required parts, in order: the file, the task, the manifest, the next step."""
    return (rf"{re.escape(str(path))}: file of task {task_id} does not match the sealed manifest \(sha256 "
            rf"[0-9a-f]{{12}}\.\.\., {re.escape(str(manifest))} sealed [0-9a-f]{{12}}\.\.\.\).*"
            r"agentkiln stage synthesize.*dvc pull")


def game_files(task, tasks_dir):
    return {rel: tasks_dir / rel for rel in task.data["file_sha256"]}


def test_every_game_file_is_sealed_in_its_split_manifest(sealed):
    listed = {}
    for split in ("sft", "rl", "test"):
        for t in json.loads(manifest_path(sealed, split).read_text())["tasks"]:
            assert t["data"]["game_file"] in t["data"]["file_sha256"]
            listed |= t["data"]["file_sha256"]
    on_disk = {f"games/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest() for f in (sealed / "games").iterdir()}
    assert listed == on_disk and any(k.endswith(".json") for k in on_disk)  # the game and its metadata


def test_an_untouched_split_loads_and_plays(tasks_dir):
    for task in load_panel(tasks_dir, "rl"):
        won, _, rows = play_expert(task, tasks_dir, max_steps=40)
        assert won and rows


def test_a_truncated_game_file_is_refused_by_name(tasks_dir):
    task = load_panel(tasks_dir, "rl")[0]
    z8 = tasks_dir / task.data["game_file"]
    z8.write_bytes(z8.read_bytes()[: z8.stat().st_size // 2])
    with pytest.raises(ArtifactError, match=refusal(z8, task.task_id, manifest_path(tasks_dir, "rl"))):
        load_panel(tasks_dir, "rl")
    # a task played without its split (a worker, a task table): refused before the interpreter starts
    with pytest.raises(ArtifactError, match=refusal(z8, task.task_id, "its split manifest")):
        make(task, tasks_dir)
    assert len(load_panel(tasks_dir, "test")) == 2  # other splits' games are untouched


@pytest.mark.parametrize("suffix", [".z8", ".json"])
def test_a_flipped_byte_is_refused_even_after_the_file_was_checked(tasks_dir, suffix):
    task = load_panel(tasks_dir, "test")[1]  # checked (and its hash cached) once, intact
    f = next(p for rel, p in game_files(task, tasks_dir).items() if rel.endswith(suffix))
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01
    f.write_bytes(bytes(data))  # the same size: only the bytes tell
    with pytest.raises(ArtifactError, match=refusal(f, task.task_id, manifest_path(tasks_dir, "test"))):
        load_panel(tasks_dir, "test")
    with pytest.raises(ArtifactError, match=refusal(f, task.task_id, "its split manifest")):
        make(task, tasks_dir)


def test_a_missing_game_file_is_refused_by_name(tasks_dir):
    task = load_panel(tasks_dir, "rl")[1]
    meta = next(p for rel, p in game_files(task, tasks_dir).items() if rel.endswith(".json"))
    meta.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(meta))}: file of task {task.task_id} is missing "
                                                r"\(sealed in .*manifest\.json\).*agentkiln stage synthesize"):
        load_panel(tasks_dir, "rl")


def test_a_task_without_sealed_digests_is_not_played(tasks_dir):
    task = load_panel(tasks_dir, "rl")[0]
    task.data.pop("file_sha256")
    with pytest.raises(ArtifactError, match=rf"task {task.task_id}: no sha256 recorded for its game file .*tw-"):
        make(task, tasks_dir)


def test_rl_and_evaluate_stop_on_a_damaged_game_before_any_work(tasks_dir, tmp_path):
    """Both stages refuse the split first: before loading a model (none exists here) or playing."""
    from agentkiln.stages.evaluate import run_evaluate
    from agentkiln.stages.rl import run_rl

    params = params_with({})
    for split in ("rl", "test"):
        task = load_panel(tasks_dir, split)[0]
        z8 = tasks_dir / task.data["game_file"]
        z8.write_bytes(z8.read_bytes()[:100])
    missing = tmp_path / "no-model"
    with pytest.raises(ArtifactError, match=r"rl/manifest\.json.*agentkiln stage synthesize"):
        run_rl(params, "main", tasks_dir, missing, tmp_path / "out", tmp_path / "reports")
    with pytest.raises(ArtifactError, match=r"test/manifest\.json.*agentkiln stage synthesize"):
        run_evaluate(params, tasks_dir, {name: missing for name in ("sft", "rl", "distilled")}, tmp_path / "reports")
    assert not (tmp_path / "out").exists() and not (tmp_path / "reports").exists()
