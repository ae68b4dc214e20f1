"""Frozen panels: a split's manifest (task ids, seeds, difficulty, data, environment versions) is
sealed by a SHA-256 of its content when it is synthesized, and checked before every use. Below
both synthesis (which seals) and evaluation and training (which load).

A panel is refused when
- its content no longer matches its digest (a task edited, added or removed by hand), or
- an environment version it records differs from the code's (the same task ids would now be
  different tasks: scores would not be comparable with earlier ones), or (load_panel)
- a file a task is played from (a TextWorld game) no longer has the sha256 its task records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from agentkiln.artifacts import TASK_FILES_KEY, verify_task_files
from agentkiln.envs import TaskSpec
from agentkiln.families import env_version

DIGEST_KEY = "sha256"


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no whitespace), digest field excluded."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its digest: what the synthesize stage writes."""
    return {**manifest, DIGEST_KEY: manifest_digest(manifest)}


def manifest_path(tasks_dir: str | Path, split: str) -> Path:
    return Path(tasks_dir) / split / "manifest.json"


def split_exists(tasks_dir: str | Path, split: str) -> bool:
    return manifest_path(tasks_dir, split).is_file()


def panel_id(tasks_dir: str | Path, split: str = "test") -> str:
    """Short identity of a panel (its digest's first 16 hex digits): scores are only ever compared
    between runs on the same panel id."""
    return load_manifest(tasks_dir, split)[DIGEST_KEY][:16]


def load_manifest(tasks_dir: str | Path, split: str) -> dict:
    """The checked manifest of a split (see the module docstring for what is refused)."""
    path = manifest_path(tasks_dir, split)
    if not path.is_file():
        made = sorted(d.name for d in Path(tasks_dir).glob("*") if split_exists(tasks_dir, d.name))
        if made:  # synthesis ran: the name is wrong, not the data missing
            raise FileNotFoundError(f"{path}: no split {split!r} under {tasks_dir}: its splits are {', '.join(made)} "
                                    "(params.yaml synthesize.splits names them)")
        raise FileNotFoundError(f"{path}: missing; run the synthesize stage first (dvc repro synthesize)")
    try:
        manifest = json.loads(path.read_text())
        tasks = manifest["tasks"]
        versions = manifest["env_versions"]
        if not isinstance(tasks, list) or not isinstance(versions, dict):
            raise TypeError("tasks must be a list and env_versions a mapping")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a valid task manifest ({e}); restore it (dvc checkout data/tasks) or "
                         "re-run the synthesize stage (dvc repro synthesize)") from e
    recorded = manifest.get(DIGEST_KEY)
    if recorded is None:
        raise ValueError(f"{path}: the manifest has no {DIGEST_KEY} field (unsealed or written by an older "
                         "agentkiln); re-run the synthesize stage (dvc repro synthesize)")
    if recorded != (actual := manifest_digest(manifest)):
        raise ValueError(f"{path}: the manifest was modified after it was frozen ({DIGEST_KEY} {recorded[:16]}..., "
                         f"content {actual[:16]}...); restore it (dvc checkout data/tasks) or re-synthesize")
    for family in sorted({t.get("family") for t in tasks if isinstance(t, dict)}):
        if versions.get(family) != (current := env_version(family)):
            raise ValueError(
                f"{path}: {family} tasks were made by environment version {versions.get(family)}, the code is "
                f"{current}: the panel is not valid for this code; re-run the synthesize stage (dvc repro synthesize)"
            )
    return manifest


def load_panel(tasks_dir: str | Path, split: str) -> list[TaskSpec]:
    """The tasks of a split, after the manifest's checks and those of the files its tasks are played
    from (their sha256, sealed in the manifest): a stage refuses a damaged game before any work."""
    path = manifest_path(tasks_dir, split)
    try:
        tasks = [TaskSpec(**t) for t in load_manifest(tasks_dir, split)["tasks"]]
    except TypeError as e:
        raise ValueError(f"{path}: not a valid task manifest ({e})") from e
    for t in tasks:
        if isinstance(t.data, dict) and TASK_FILES_KEY in t.data:
            verify_task_files(t.task_id, t.data[TASK_FILES_KEY], tasks_dir, path)
    return tasks
