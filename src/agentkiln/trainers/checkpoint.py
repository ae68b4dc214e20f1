"""Resumable training state (RL iterations, SFT and distillation epochs, on-policy rounds): weights,
optimizer and scheduler state, every RNG, the history so far.

A checkpoint is a directory written atomically (to a temporary name, synced, then renamed; the previous
one is set aside until the new one has its name) and keyed by a fingerprint of everything the run
depends on (stage params, seed, starting model, task pool), so a run only ever resumes its own
interrupted self: a changed param starts afresh. A process killed at any instant (SIGKILL included)
leaves either the previous checkpoint or the new one, never a torn one; a write that fails (a full
disk) raises CheckpointWriteError naming the checkpoint and the next step, and keeps the previous one.

A stage removes its checkpoint with `finish`, only after every output it writes (model, reports,
MLflow logging) is written: a failure on the way leaves it, and the rerun resumes instead of starting over.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from agentkiln.artifacts import ArtifactError

PAUSE_ENV = "AGENTKILN_PAUSE_AFTER_CHECKPOINT"  # seconds to wait after each checkpoint (tests only)
STATE_FILE = "state.pt"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (errno kept); the message names it and says what to do."""


def _sibling(ckpt_dir: Path, suffix: str) -> Path:
    return ckpt_dir.with_name(ckpt_dir.name + suffix)


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`: torch's zip writer turns a failed write into a RuntimeError of its own
    ("unexpected pos ...") raised while the OSError is being handled."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


def _write_failure(ckpt_dir: Path, e: OSError) -> CheckpointWriteError:
    previous = any((d / STATE_FILE).is_file() for d in (ckpt_dir, _sibling(ckpt_dir, ".old")))
    kept = "the previous checkpoint is kept and a rerun resumes from it" if previous else "no earlier checkpoint exists"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = next(p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists())
        try:
            free = f", {shutil.disk_usage(where).free / 2**20:.1f} MiB free there"
        except OSError:
            free = ""
        msg = (f"{ckpt_dir}: cannot write the checkpoint: the disk holding it is full ({os.strerror(e.errno)}{free}); "
               f"free space on it, or move {ckpt_dir.parent} to a larger disk and link it back, then run the stage "
               f"again ({kept})")
    else:
        reason = f"{os.strerror(e.errno)}: {e.filename}" if e.errno and e.filename else str(e)
        msg = f"{ckpt_dir}: cannot write the checkpoint ({reason}); fix that, then run the stage again ({kept})"
    err = CheckpointWriteError(msg)
    err.errno = e.errno
    return err


def fingerprint(*parts: object, files: list[Path] = ()) -> str:
    """sha256 over JSON of `parts` and the bytes of `files` (a file, or each file of a directory, sorted)."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for root in files:
        root = Path(root)
        found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in found:
            h.update(str(f.relative_to(root) if f != root else f.name).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def save(ckpt_dir: Path, key: str, state: dict, rng: random.Random | None = None,
         gen: torch.Generator | None = None) -> None:
    """Write `state` (module/optimizer state dicts, iteration, history, ...) plus the RNG states: the
    run's own `rng` and `gen` (when given) and the process-wide ones (torch CPU and CUDA, Python's
    `random`, NumPy)."""
    ckpt_dir = Path(ckpt_dir)
    tmp, aside = _sibling(ckpt_dir, ".tmp"), _sibling(ckpt_dir, ".old")
    full = dict(state, fingerprint=key, torch_rng=torch.get_rng_state(), global_python_rng=random.getstate(),
                numpy_rng=np.random.get_state())
    if rng is not None:
        full["python_rng"] = rng.getstate()
    if gen is not None:
        full["torch_gen"] = gen.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        full["cuda_rng"] = torch.cuda.get_rng_state_all()
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # through a Python file: a failed write raises OSError with its errno, where torch.save(path)
        # raises a bare "basic_ios::clear: iostream error"
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        if ckpt_dir.exists():  # set aside, not deleted, until the new one has its name (load falls back to it)
            shutil.rmtree(aside, ignore_errors=True)
            ckpt_dir.rename(aside)
        tmp.rename(ckpt_dir)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written state is never left for a rerun, nor its space taken
        cause = _os_error(e)
        if cause is None:
            raise
        raise _write_failure(ckpt_dir, cause) from None
    shutil.rmtree(aside, ignore_errors=True)
    pause = os.environ.get(PAUSE_ENV)
    if pause:  # the resume tests SIGKILL the stage in this window, for real, at a known point
        print(f"checkpoint written to {ckpt_dir}; pausing {pause} s ({PAUSE_ENV})", flush=True)
        time.sleep(float(pause))


def _state_file(ckpt_dir: Path) -> Path | None:
    f = ckpt_dir / STATE_FILE
    if not f.is_file():  # killed between setting the previous checkpoint aside and renaming the new one
        f = _sibling(ckpt_dir, ".old") / STATE_FILE
    return f if f.is_file() else None


def load(ckpt_dir: Path, key: str, rng: random.Random | None = None, gen: torch.Generator | None = None) -> dict | None:
    """The saved state (RNGs restored in place) if a checkpoint of this very run exists, else None."""
    ckpt_dir = Path(ckpt_dir)
    if (f := _state_file(ckpt_dir)) is None:
        return None
    try:
        state = torch.load(f, weights_only=False)
    except Exception as e:  # written atomically (tmp dir + rename), so this is damage from outside
        raise ArtifactError(f"{f}: unreadable checkpoint ({type(e).__name__}: {e}); delete {ckpt_dir} to start "
                            "this stage over, then run dvc repro again") from None
    if not isinstance(state, dict) or state.get("fingerprint") != key:
        return None
    if rng is not None:
        rng.setstate(state["python_rng"])
    if gen is not None:
        gen.set_state(state["torch_gen"])
    torch.set_rng_state(state["torch_rng"])
    if "global_python_rng" in state:
        random.setstate(state["global_python_rng"])
    if "numpy_rng" in state:
        np.random.set_state(state["numpy_rng"])
    if "cuda_rng" in state and torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda_rng"]):
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state


def clear(ckpt_dir: Path) -> None:
    ckpt_dir = Path(ckpt_dir)
    for d in (ckpt_dir, _sibling(ckpt_dir, ".tmp"), _sibling(ckpt_dir, ".old")):
        shutil.rmtree(d, ignore_errors=True)


def finish(report: dict, ckpt_dir: Path | None, outputs: Callable[[dict], object] | None = None) -> dict:
    """The end of a training stage: `outputs(report)` writes what the stage writes besides its model
    (reports, MLflow metrics, the logged model), then the checkpoint goes. Only then: should any
    output fail (a full disk while logging the model), the checkpoint stays and the rerun resumes
    from it (after its last epoch: no training again) instead of starting over. Returns `report`."""
    if outputs is not None:
        outputs(report)
    if ckpt_dir:
        clear(ckpt_dir)
    return report
