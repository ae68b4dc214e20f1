"""The Linux process table for tests that stop real runs: what a run started, and whether it is gone.

What a run started is read from /proc: every process whose environment carries the run's marker
variable, plus every descendant seen while the run was alive."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

MARK = "AGENTKILN_SIGNAL_TEST"


def stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process, None once it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    return rest[0], int(rest[1]), rest[19]


def alive(proc: tuple[int, str]) -> bool:
    """The very process (pid and start time) still exists and is not a zombie."""
    s = stat(proc[0])
    return s is not None and s[2] == proc[1] and s[0] != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def marked(token: str) -> set[tuple[int, str]]:
    """Live processes whose environment holds MARK=token."""
    want = f"{MARK}={token}".encode()
    found = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            env = Path(f"/proc/{p}/environ").read_bytes()
        except OSError:
            continue
        if want in env.split(b"\0") and (s := stat(int(p))) is not None and s[0] != "Z":
            found.add((int(p), s[2]))
    return found


def descendants(root: int) -> set[tuple[int, str]]:
    table = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := stat(int(p))) is not None}
    out, frontier = set(), [root]
    while frontier:
        parent = frontier.pop()
        for p, (state, ppid, start) in table.items():
            if ppid == parent and (p, start) not in out:
                out.add((p, start))
                frontier.append(p)
    return out


class Run:
    """A command started in a new session (its pid is its process group), its output in a file, and
    every process seen under it while it ran."""

    def __init__(self, args: list[str], cwd: Path, env: dict, log: Path):
        self.token = uuid.uuid4().hex
        self.log = log
        # SIGINT as at a terminal: a shell's background job (e.g. a CI runner's) inherits it ignored
        self.proc = subprocess.Popen(args, cwd=cwd, env=env | {MARK: self.token}, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.seen: set[tuple[int, str]] = set()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def watch_until(self, ready, timeout: float) -> None:
        """Record descendants until `ready(self)` holds (or fail on timeout / early exit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.seen |= descendants(self.proc.pid)
            if ready(self):
                return
            assert self.proc.poll() is None, f"the run ended before the signal:\n{self.output()[-4000:]}"
            time.sleep(0.1)
        pytest.fail(f"not ready after {timeout:.0f} s:\n{self.output()[-4000:]}")

    def processes(self, needle: str) -> list[tuple[int, str]]:
        return [p for p in self.seen if alive(p) and needle in cmdline(p[0])]

    def survivors(self) -> list[str]:
        return [f"{p} {cmdline(p)[:200]}" for p, _ in {q for q in self.seen | marked(self.token) if alive(q)}]

    def wait_gone(self, timeout: float) -> float:
        """Seconds until the run and everything it started are gone; fails after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None and not self.survivors():
                return time.monotonic() - start
            time.sleep(0.1)
        left = self.survivors()
        for p, _ in self.seen | marked(self.token):  # leave nothing behind whatever the outcome
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        pytest.fail(f"still running {timeout:.0f} s after the signal: {left}\n{self.output()[-4000:]}")
