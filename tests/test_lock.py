"""requirements.lock (scripts/lock.sh) against pyproject.toml and the .venv setup.sh made from it: every
dependency locked at a version its specifier allows, every file pinned by sha256, the locked set closed
under its own dependencies (setup installs it with --no-deps), and the .venv holding exactly those
versions. A dependency changed in pyproject.toml without `bash scripts/lock.sh` fails here, naming it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# installed by setup.sh itself: torch (its CPU and CUDA builds are different files) and, with PyPI's
# CUDA build, the libraries it brings
NOT_LOCKED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 digests), from a `uv pip compile --generate-hashes` file."""
    text = path.read_text()
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", block)
        if m:
            out[canonicalize_name(m.group(1))] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return out


LOCK = read_lock(ROOT / "requirements.lock")


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_the_lock_reader_reads_a_lock(tmp_path):
    sample = ("# header\naccelerate==1.16.0 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
              + "\n    # via peft\nPyYAML==6.0.4 \\\n    --hash=sha256:" + "c" * 64 + "\n")
    p = tmp_path / "r.lock"
    p.write_text(sample)
    assert read_lock(p) == {"accelerate": ("1.16.0", ["a" * 64, "b" * 64]), "pyyaml": ("6.0.4", ["c" * 64])}


def test_every_dependency_is_locked_at_a_version_pyproject_allows():
    assert len(LOCK) > 100, "requirements.lock looks truncated: run `bash scripts/lock.sh`"
    wrong = []
    for req in project_requirements():
        name = canonicalize_name(req.name)
        if NOT_LOCKED.match(name):
            assert name not in LOCK, f"{name} is installed by setup.sh, not from requirements.lock"
            continue
        if name not in LOCK:
            wrong.append(f"{req} is not in requirements.lock")
        elif not req.specifier.contains(LOCK[name][0], prereleases=True):
            wrong.append(f"{req}: requirements.lock has {LOCK[name][0]}")
    assert not wrong, "; ".join(wrong) + ": run `bash scripts/lock.sh` and commit requirements.lock"


def test_every_locked_package_is_pinned_by_digest():
    missing = [name for name, (_, digests) in LOCK.items() if not digests]
    assert not missing, f"requirements.lock pins no sha256 for {missing}"
    assert not [n for n in LOCK if NOT_LOCKED.match(n)], "torch and its CUDA libraries are setup.sh's, not the lock's"


def test_the_locked_set_holds_every_dependency_of_its_packages():
    """setup.sh installs the lock with --no-deps: a package's dependency missing from it would be missing
    from .venv. Checked on the installed metadata, markers evaluated for this Python."""
    env = default_environment() | {"extra": ""}
    missing = []
    for name in filter(_installed, LOCK):  # one not installed: test_the_venv_holds_the_locked_versions says so
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            if dep not in LOCK and not NOT_LOCKED.match(dep):
                missing.append(f"{name} needs {req}")
    assert not missing, "; ".join(missing)


def test_the_venv_holds_the_locked_versions():
    drift = [f"{name} {metadata.version(name)} (locked {version})" for name, (version, _) in LOCK.items()
             if _installed(name) and metadata.version(name) != version]
    absent = [name for name in LOCK if not _installed(name)]
    assert not drift and not absent, (f"installed: {drift}; not installed: {absent}: "
                                      "run `bash scripts/setup.sh` (it reinstalls when requirements.lock changes)")


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False
