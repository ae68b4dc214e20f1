"""glibc's malloc keeps freed tensors of a few MiB: it raises its mmap threshold to the largest block
freed (up to 32 MiB), so later KV caches and activations of that size come from the heap, where they
fragment and are never given back. A 135M model playing 12-turn, 2,048-token episodes grew by ~1-2 GiB
per RL iteration on a CPU until the kernel killed it; with the threshold fixed at 1 MiB its resident
memory stays flat (blocks that large are mapped and unmapped whole; smaller ones are unaffected)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h); setting it also turns the dynamic threshold off
THRESHOLD = 1 << 20
_done = False


def return_large_blocks(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process (once; elsewhere, e.g. macOS or musl, nothing): blocks
    of `threshold` bytes or more go back to the system when freed. True when set."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # not glibc
        _done = False
    return _done
