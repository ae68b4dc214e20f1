"""Resumable training state (RL iterations, SFT and distillation epochs, on-policy rounds): weights,
optimizer and scheduler state, every RNG, the history so far.

A checkpoint is a directory written atomically (to a temporary name, then renamed) and keyed by a
fingerprint of everything the run depends on (stage params, seed, starting model, task pool), so
a run only ever resumes its own interrupted self: a changed param starts afresh. A process killed at
any instant (SIGKILL included) leaves either the previous checkpoint or the new one, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import random
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from agentkiln.artifacts import ArtifactError

PAUSE_ENV = "AGENTKILN_PAUSE_AFTER_CHECKPOINT"  # seconds to wait after each checkpoint (tests only)
STATE_FILE = "state.pt"


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
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    full = dict(state, fingerprint=key, torch_rng=torch.get_rng_state(), global_python_rng=random.getstate(),
                numpy_rng=np.random.get_state())
    if rng is not None:
        full["python_rng"] = rng.getstate()
    if gen is not None:
        full["torch_gen"] = gen.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        full["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(full, tmp / STATE_FILE)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    tmp.rename(ckpt_dir)
    pause = os.environ.get(PAUSE_ENV)
    if pause:  # the resume tests SIGKILL the stage in this window, for real, at a known point
        print(f"checkpoint written to {ckpt_dir}; pausing {pause} s ({PAUSE_ENV})", flush=True)
        time.sleep(float(pause))


def load(ckpt_dir: Path, key: str, rng: random.Random | None = None, gen: torch.Generator | None = None) -> dict | None:
    """The saved state (RNGs restored in place) if a checkpoint of this very run exists, else None."""
    f = Path(ckpt_dir) / STATE_FILE
    if not f.is_file():
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
    shutil.rmtree(ckpt_dir, ignore_errors=True)
