"""policy/allocator.py: with glibc's mmap threshold fixed, freed tensors of a few MiB go back to the system
(judged by the process's resident memory, in a fresh interpreter each)."""

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
from agentkiln.policy.allocator import return_large_blocks
if sys.argv[1] == "fixed":
    assert return_large_blocks()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
keep = []
start = rss()
for i in range(40):  # growing KV-cache-like blocks, freed, with small survivors between them (fragmentation)
    block = torch.ones(((i % 8) + 1) << 20, dtype=torch.uint8)
    keep.append(torch.ones(64))
    del block
print((rss() - start) / 2**20)
"""


def grown(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_of_a_few_mib_go_back_to_the_system():
    default, fixed = grown("default"), grown("fixed")
    assert default > 6, f"glibc kept {default:.1f} MiB by default: the probe no longer shows the retention"
    assert fixed < 3, f"{fixed:.1f} MiB kept with the threshold fixed"
