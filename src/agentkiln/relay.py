"""A child's output relayed line by line into this process's log (the pipeline relays `dvc repro`).

Read as text, every progress-bar refresh (tqdm's `\r`) arrives as a line of its own: a pipeline's
output was ~2,100 refreshes in 2,150 lines. `Relay` passes a bar's first line, its last (100%) and
at most one every `every_s` seconds in between, drops blank lines, and strips the child's own
Prefect timestamp (and INFO tag) from its log lines: the relaying logger adds its own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

BAR = re.compile(r"(?P<desc>[^|]*?):\s+(?P<pct>\d{1,3})%\|")
STAMP = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} \| (?:INFO +\| )?")


class Relay:
    def __init__(self, sink: Callable[[str], object], every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.sink, self.every_s, self.clock = sink, every_s, clock
        self.shown: dict[str, float] = {}  # bar -> when its last line was passed on

    def __call__(self, line: str) -> None:
        line = STAMP.sub("", line.rstrip())
        if not line.strip():
            return
        bar = BAR.search(line)
        if bar is not None:
            desc, now = bar["desc"].strip(), self.clock()
            last = self.shown.get(desc)
            if int(bar["pct"]) >= 100:
                self.shown.pop(desc, None)
            elif last is not None and now - last < self.every_s:
                return
            else:
                self.shown[desc] = now
        self.sink(line)
