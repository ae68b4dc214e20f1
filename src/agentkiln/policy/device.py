"""Where a policy computes and in what precision (params: `compute`).

`device: auto` picks cuda when torch sees one, else cpu. `dtype: bf16` runs forward passes under
bf16 autocast while the weights (and so the optimizer's master copy) stay fp32: the standard mixed
precision of TRL / HF Trainer, and it works on CPU too. Sampling draws from a generator on the
policy's device, seeded per rollout, so the same params and seed give the same episodes on the same
device.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda if available else cpu; `cuda[:N]` without a visible GPU is an error that says what to set."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"compute.device = {name}: torch sees no CUDA device (torch {torch.__version__}); "
                               "set compute.device to auto or cpu, or install a CUDA build of torch")
        index = torch.device(name).index
        if index is not None and index >= torch.cuda.device_count():
            raise RuntimeError(f"compute.device = {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device(name)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` (a no-op context for fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on `device` (torch.multinomial needs its generator where its input is)."""
    return torch.Generator(device=device).manual_seed(seed)


def check_attn(name: str, device: torch.device) -> None:
    if name == "flash_attention_2" and device.type != "cuda":
        raise ValueError(f"compute.attn_implementation = flash_attention_2 needs a CUDA device (the policy is on "
                         f"{device}); use sdpa")
