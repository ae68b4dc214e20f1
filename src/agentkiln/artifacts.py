"""What crosses a stage boundary is checked where it is read, and a refusal names the file and what to run.

- JSON files (a policy's agent.json, reports/metrics.json, outcomes.json, ...) are read through
  `read_json`: unreadable, unparsable or off-schema content raises `ArtifactError` naming the file,
  the field and the command that rebuilds it (never a bare JSONDecodeError or KeyError later on).
- A directory of files written together (a saved policy) carries a manifest: the sha256 of every file
  and a format version, written last by `write_manifest` and checked by `verify_manifest` before any
  file is used: a missing, truncated or overwritten file (even finite garbage weights) is refused.
- A task played from files (TextWorld's compiled games) records their sha256 in its data, sealed with
  its split manifest; `verify_task_files` checks them when a split is loaded and when a game starts.

Tables have their own contracts (agentkiln.schemas: pandera; agentkiln.data_checks: Great Expectations).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from agentkiln.errors import UserError

MANIFEST_VERSION = 1  # the layout of a manifest file (bump when its fields change)


class ArtifactError(UserError, ValueError):
    """A stage's input is missing, corrupt, tampered with or of another format."""


class MissingArtifactError(ArtifactError, FileNotFoundError):
    """A stage's input file does not exist."""


# Which DVC stage writes what (dvc.yaml): the command a refusal suggests.
_PRODUCERS = [
    (re.compile(r"(^|/)models/base(/|$)"), "dvc repro base"),
    (re.compile(r"(^|/)models/sft(/|$)"), "dvc repro sft"),
    (re.compile(r"(^|/)models/rl/(?P<stage>[^/]+)(/|$)"), "dvc repro rl@{stage}"),
    (re.compile(r"(^|/)models/distilled(/|$)"), "dvc repro distill"),
    (re.compile(r"(^|/)data/tasks(/|$)"), "dvc repro synthesize"),
    (re.compile(r"(^|/)reports/(metrics|outcomes|comparisons)\.json$"), "dvc repro evaluate"),
    (re.compile(r"(^|/)reports/sft_metrics\.json$"), "dvc repro sft"),
    (re.compile(r"(^|/)reports/distill_metrics\.json$"), "dvc repro distill"),
    (re.compile(r"(^|/)reports/rl/(?P<stage>[^/]+)/"), "dvc repro rl@{stage}"),
]


def rebuild_hint(path: str | Path) -> str:
    """What to run to rebuild `path`: its DVC stage where the path says which, else a generic line."""
    posix = Path(path).as_posix()
    for pattern, command in _PRODUCERS:
        m = pattern.search(posix)
        if m:
            return f"rebuild it with `{command.format(**m.groupdict())}` (or restore DVC's copy: `dvc checkout`)"
    return "rebuild it by re-running the stage that wrote it (`dvc repro`), or restore it (`dvc checkout`)"


def _schema_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors()[:8]:
        loc = ".".join(str(p) for p in e["loc"]) or "<top level>"
        value = e.get("input")
        shown = "" if isinstance(value, (dict, list)) else f" = {value!r}"
        lines.append(f"{loc}{shown}: {e['msg']}")
    more = err.error_count() - len(lines)
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


def read_json(path: str | Path, schema: type[BaseModel] | None = None, what: str = "JSON file",
              hint: str | None = None, as_model: bool = True) -> Any:
    """The parsed content of `path`, validated by `schema` when given (a pydantic model: returned as
    its instance, or as the parsed JSON itself with `as_model=False`). Raises MissingArtifactError /
    ArtifactError naming the file, what is wrong with it and how to rebuild it (`hint`; default: from
    the path)."""
    path = Path(path)
    hint = hint or rebuild_hint(path)
    if not path.is_file():
        raise MissingArtifactError(f"{path}: {what} missing; {hint}")
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                            f"{hint}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: {what} is not valid JSON ({type(e).__name__}: {e}); {hint}") from None
    except OSError as e:
        raise ArtifactError(f"{path}: {what} cannot be read ({e}); {hint}") from None
    if schema is None:
        return data
    try:
        model = schema.model_validate(data)
    except ValidationError as e:
        raise ArtifactError(f"{path}: {what} does not match its schema ({_schema_errors(e)}); {hint}") from None
    return model if as_model else data


def write_json(path: str | Path, data: Any) -> Path:
    """Write JSON atomically (a temporary file renamed over `path`): a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- directory manifests
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=4096)
def _sha256_of(path: str, stamp: tuple[int, ...]) -> str:
    return sha256_file(Path(path))


def sha256_cached(path: str | Path) -> str:
    """sha256_file, read once per process per version of the file: keyed by path, size, mtime, ctime and
    inode, so a rewritten, truncated or replaced file is read again (ctime: a restored mtime still shows)."""
    st = os.stat(path)
    return _sha256_of(os.path.abspath(path), (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))


# --------------------------------------------------------------------------- task files
TASK_FILES_KEY = "file_sha256"  # in a task's data: path relative to the tasks directory -> sha256
TASK_FILES_HINT = ("re-run synthesize (`agentkiln stage synthesize` or `dvc repro synthesize`), or fetch the "
                   "team's copy of the data (`dvc pull`)")


def verify_task_files(task_id: str, files, tasks_dir: str | Path, sealed_in: str | Path) -> None:
    """Every file a task is played from (TextWorld's compiled game) present with the sha256 recorded at
    synthesis and sealed with its split manifest (`sealed_in` names it). Checked before play: a truncated
    game kills the process inside the game interpreter, a changed one would be played silently."""
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ArtifactError(f"task {task_id}: {TASK_FILES_KEY} in {sealed_in} must map file paths to sha256 "
                            f"digests, got {files!r}; {TASK_FILES_HINT}")
    for rel, digest in sorted(files.items()):
        f = Path(tasks_dir) / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ArtifactError(f"task {task_id}: {sealed_in} lists a file outside the tasks directory ({rel!r}); "
                                f"{TASK_FILES_HINT}")
        if not f.is_file():
            raise MissingArtifactError(f"{f}: file of task {task_id} is missing (sealed in {sealed_in}); "
                                       f"{TASK_FILES_HINT}")
        if (actual := sha256_cached(f)) != digest:
            raise ArtifactError(f"{f}: file of task {task_id} does not match the sealed manifest (sha256 "
                                f"{actual[:12]}..., {sealed_in} sealed {digest[:12]}...): truncated, corrupt or "
                                f"replaced; {TASK_FILES_HINT}")


class Manifest(BaseModel):
    """`<dir>/<manifest file>`: what a directory held when it was written."""

    model_config = ConfigDict(extra="forbid", strict=True)

    manifest_version: int
    kind: str = Field(min_length=1, description="what the directory is (e.g. agentkiln-policy)")
    format_version: int = Field(ge=1, description="the layout of that kind of directory")
    files: dict[str, str] = Field(min_length=1, description="relative path -> sha256 of its bytes")
    meta: dict = Field(default_factory=dict, description="kind-specific facts (e.g. the training format)")


def write_manifest(directory: str | Path, name: str, kind: str, format_version: int, meta: dict) -> Path:
    """Hash every file under `directory` (but the manifest) and write the manifest, last and atomically."""
    directory = Path(directory)
    files = {f.relative_to(directory).as_posix(): sha256_file(f)
             for f in sorted(directory.rglob("*")) if f.is_file() and f.name not in (name, name + ".tmp")}
    manifest = Manifest(manifest_version=MANIFEST_VERSION, kind=kind, format_version=format_version,
                        files=files, meta=meta)
    return write_json(directory / name, manifest.model_dump())


def verify_manifest(directory: str | Path, name: str, kind: str, format_version: int,
                    required: tuple[str, ...] = (), hint: str | None = None) -> Manifest:
    """The directory's manifest after checking it: its kind and format, and that every file it lists
    exists with the recorded sha256 (`required` files must be listed). Files it does not list are
    ignored. Raises MissingArtifactError / ArtifactError naming the file."""
    directory = Path(directory)
    hint = hint or rebuild_hint(directory)
    manifest = read_json(directory / name, Manifest, f"manifest of {directory}", hint)
    if manifest.manifest_version != MANIFEST_VERSION or manifest.kind != kind:
        raise ArtifactError(f"{directory / name}: a {manifest.kind!r} manifest version {manifest.manifest_version}; "
                            f"this agentkiln reads {kind!r} version {MANIFEST_VERSION}; {hint}")
    if manifest.format_version != format_version:
        raise ArtifactError(f"{directory}: saved in {kind} format {manifest.format_version}, this agentkiln reads "
                            f"format {format_version}; {hint}")
    for f in required:
        if f not in manifest.files:
            raise ArtifactError(f"{directory / name}: does not list {f}; {hint}")
    for rel, digest in manifest.files.items():
        f = directory / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ArtifactError(f"{directory / name}: lists a path outside the directory ({rel!r}); {hint}")
        if not f.is_file():
            raise MissingArtifactError(f"{f}: missing (listed in {directory / name}); {hint}")
        if (actual := sha256_file(f)) != digest:
            raise ArtifactError(f"{f}: content changed since it was saved (sha256 {actual[:12]}..., the manifest "
                                f"recorded {digest[:12]}...): corrupt or overwritten; {hint}")
    return manifest


# --------------------------------------------------------------------------- report schemas
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # readers use these fields; writers may add more


class PanelMetrics(_Open):
    success: float = Field(ge=0, le=1)
    ci_low: float | None = Field(None, ge=0, le=1)
    ci_high: float | None = Field(None, ge=0, le=1)
    n_tasks: int = Field(ge=0)
    mean_turns: float | None = Field(None, ge=0)
    invalid_rate: float | None = Field(None, ge=0, le=1)


class PolicyMetrics(PanelMetrics):
    ood: PanelMetrics | None = None


class MetricsFile(RootModel[dict[str, PolicyMetrics]]):
    """reports/metrics.json: policy -> its test-panel metrics (and `ood`)."""


class OutcomesFile(BaseModel):
    """reports/outcomes.json: the panels' ids and every policy's per-task outcome (0/1) per panel."""

    model_config = ConfigDict(extra="forbid", strict=True)

    panels: dict[str, str]
    outcomes: dict[str, dict[str, dict[str, Annotated[int, Field(ge=0, le=1)]]]]
