"""One call that makes a run deterministic: every RNG seeded and torch's thread count fixed."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, threads: int) -> None:
    """Same params + seed => same metrics on the same machine (CPU kernels are deterministic at a
    fixed thread count). On CUDA, cuBLAS gets the workspace setting its deterministic mode needs and
    an op with no deterministic kernel warns instead of stopping the run (docs/scale.md)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)
