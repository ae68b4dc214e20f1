"""Resumable RL training state: weights, optimizer moments, every RNG, the history so far.

A checkpoint is a directory written atomically (to a temporary name, then renamed) and keyed by a
fingerprint of everything the run depends on (stage params, seed, starting model, task pool), so
a run only ever resumes its own interrupted self: a changed param starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import torch

STATE_FILE = "state.pt"


def fingerprint(*parts: object, files: list[Path] = ()) -> str:
    """sha256 over JSON of `parts` and the bytes of `files` (each directory's files, sorted)."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for root in files:
        for f in sorted(p for p in Path(root).rglob("*") if p.is_file()):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def save(ckpt_dir: Path, key: str, state: dict, rng: random.Random, gen: torch.Generator) -> None:
    """Write `state` (module/optimizer state dicts, iteration, history, ...) plus all RNG states."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    full = dict(state, fingerprint=key, python_rng=rng.getstate(), torch_gen=gen.get_state(),
                torch_rng=torch.get_rng_state())
    torch.save(full, tmp / STATE_FILE)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    tmp.rename(ckpt_dir)


def load(ckpt_dir: Path, key: str, rng: random.Random, gen: torch.Generator) -> dict | None:
    """The saved state (RNGs restored in place) if a checkpoint of this very run exists, else None."""
    f = Path(ckpt_dir) / STATE_FILE
    if not f.is_file():
        return None
    state = torch.load(f, weights_only=False)
    if state.get("fingerprint") != key:
        return None
    rng.setstate(state["python_rng"])
    gen.set_state(state["torch_gen"])
    torch.set_rng_state(state["torch_rng"])
    return state


def clear(ckpt_dir: Path) -> None:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
