"""Inform 7 compiles without their Index (imported by a synthesis worker before its first TextWorld task).

TextWorld compiles a cooking or coin-collector game twice (once to record its walkthrough, once for
the game file), each with Inform 7's `ni`, which also writes an HTML Index of the story: ~20% of
`ni`'s time, thrown away with its temporary project folder. `--noindex` skips it and the story file
comes out with the same bytes (tests/test_synthesis.py on a cooking game; the default's data/tasks
kept its dvc.lock hash). Like textworld_kb, it lives apart from the generator: it changes no byte of
any task, so the family's environment version stays as it was.
"""

from __future__ import annotations

import os
import subprocess

from textworld.generator.inform7 import world2inform7


class _NoIndex:
    """world2inform7's `subprocess`, with `--noindex` added to every `ni` call."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def check_output(cmd, *args, **kwargs):
        if cmd and os.path.basename(str(cmd[0])) == "ni" and "--noindex" not in cmd:
            cmd = [*cmd, "--noindex"]
        return subprocess.check_output(cmd, *args, **kwargs)


world2inform7.subprocess = _NoIndex()  # the module's only use of subprocess: the ni and inform6 calls
