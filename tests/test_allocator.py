"""policy/allocator.py: freed tensors of a few MiB, which glibc keeps in the process's heap, leave it when
the rollout engine releases the free memory (judged by resident memory, in a fresh interpreter each)."""

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from agentkiln.policy.allocator import release_free_memory
libc = ctypes.CDLL("libc.so.6")
# glibc raises its mmap threshold by itself once a large mapping is freed; how far depends on what torch
# freed before (the probe kept 7 to 60 MiB from run to run). Fixed here at what one freed 32 MiB block gives,
# so every block below comes from the heap and stays there: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD.
assert libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 64 << 20)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
torch.ones(64)
start = rss()
blocks, keep = [], []
for i in range(10):  # ten 4 MiB KV-cache-like blocks, each followed by a small survivor (fragmentation)
    blocks.append(torch.ones(4 << 20, dtype=torch.uint8))
    keep.append(torch.ones(64))
del blocks  # 40 MiB of free chunks between survivors: the heap's top cannot be trimmed past them
if sys.argv[1] == "released":
    assert release_free_memory()
print((rss() - start) / 2**20)
"""


def grown(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_of_a_few_mib_go_back_to_the_system():
    kept, released = grown("kept"), grown("released")
    assert kept > 32, f"glibc kept {kept:.1f} MiB: the probe no longer shows the retention"
    assert released < 3, f"{released:.1f} MiB still resident after release_free_memory"


def test_the_rollout_engine_releases_after_each_chunk(monkeypatch):
    """The engine hands freed memory back once per chunk of episodes it plays (5 episodes, chunks of 2)."""
    from agentkiln.envs import TaskSpec
    from agentkiln.policy import allocator
    from agentkiln.rollout import engine
    from agentkiln.rollout.agents import RandomAgent

    calls = []
    monkeypatch.setattr(engine, "release_free_memory", lambda: calls.append(allocator.release_free_memory()))
    lake = TaskSpec("t", "gym-toytext", 0, difficulty={"max_turns": 4}, data={"game": "frozenlake", "map": ["SF", "FG"]})
    agent = RandomAgent(seed=0)
    agent.batch_size = 2
    episodes = engine.run_episodes(agent, [lake], None, max_turns=4, group_size=5)
    assert len(episodes) == 5 and len(calls) == 3
