"""Where a policy computes and in what precision (params: `compute`).

`device: auto` picks cuda when torch sees one, else cpu. `dtype: bf16` runs forward passes under
bf16 autocast while the weights (and so the optimizer's master copy) stay fp32: the standard mixed
precision of TRL / HF Trainer, and it works on CPU too. `dtype: auto` takes bf16 where the device
computes it natively (`native_bf16`) and fp32 elsewhere. Sampling draws from a generator on the
policy's device, seeded per rollout, so the same params and seed give the same episodes on the same
device.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX instructions (where bf16 autocast runs matmuls at 2-4x fp32's speed; elsewhere it emulates bf16
    and is slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: ask torch what its kernels were built to use
        return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says: where a figure was measured."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform  # noqa: PLC0415

    return platform.processor() or platform.machine()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> bf16 where the device computes it natively, else fp32; `fp32` / `bf16` as said."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return DTYPES[name]


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
