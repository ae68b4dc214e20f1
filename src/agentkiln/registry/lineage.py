"""Lineage of a registered model: which code (git commit), which hyper-parameters (params.yaml
hash) and which data and models (DVC output hashes from dvc.lock) produced it."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import yaml

MAX_TAG_VALUE = 5000  # MLflow's limit on a model-version tag value


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit(root: str | Path) -> str:
    """HEAD's sha, with "-dirty" when tracked files differ from it; "unknown" outside git.

    dvc.lock is left out: every `dvc repro` rewrites it, and its hashes are recorded separately
    (lineage.data.*); params.yaml is not, since editing params without committing is dirty."""
    root = Path(root)
    sha = _git(root, "rev-parse", "HEAD")
    if not sha:
        return "unknown"
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock")
    return sha + ("-dirty" if status else "")


def commit_date(root: str | Path) -> str:
    """HEAD's commit date (ISO 8601), "unknown" outside git: a report's date that stays the same
    for the same commit (a wall-clock date would change the bytes of every re-run)."""
    return _git(Path(root), "log", "-1", "--format=%cI") or "unknown"


def params_hash(path: str | Path) -> str:
    """First 16 hex chars of sha256 of params.yaml's bytes ("missing" when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def dvc_lock_hashes(root: str | Path) -> dict[str, str]:
    """{out path: md5} for every stage's outs in dvc.lock ({} when there is none)."""
    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return {}
    data = yaml.safe_load(lock.read_text()) or {}
    hashes: dict[str, str] = {}
    for stage in (data.get("stages") or {}).values():
        for out in (stage or {}).get("outs") or []:
            if isinstance(out, dict) and "path" in out and "md5" in out:
                hashes[str(out["path"])] = str(out["md5"])
    return dict(sorted(hashes.items()))


def lineage_tags(root: str | Path, extra: dict | None = None) -> dict[str, str]:
    """Tags for a model version: lineage.git_commit, lineage.params_hash, lineage.data.<path>
    (one per DVC output), then `extra` as given (values turned into strings)."""
    root = Path(root)
    tags = {
        "lineage.git_commit": git_commit(root),
        "lineage.params_hash": params_hash(root / "params.yaml"),
    }
    for path, md5 in dvc_lock_hashes(root).items():
        tags[f"lineage.data.{path.rstrip('/')}"] = md5
    for k, v in (extra or {}).items():
        tags[str(k)] = str(v)[:MAX_TAG_VALUE]
    return tags
