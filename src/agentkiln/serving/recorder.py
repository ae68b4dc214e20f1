"""Token-in/token-out recording: with `agentkiln endpoint --record DIR` every conversation the endpoint
serves is kept as an episode, one JSON file per episode (`DIR/<episode id>.json`), rewritten after
each served turn: the record format of logged training episodes (trainers.episode_log: the ids as
served, each reply's span, per-token behaviour log-probs and constrained-decoding choices), plus who
served it (model, version, tokenizer digest and vocabulary size) and its outcome, which the client posts
once (`POST /v1/episodes/{id}/reward`; again only with `replace`) or leaves unset.
Files are replaced atomically: a reader never sees half an episode. The directory is bounded in bytes
(`max_bytes`): a turn that would pass the bound is not recorded (served all the same), counted and logged.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from agentkiln.collected import RECORD_KIND
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.episode import to_record as record

EPISODE_ID = re.compile(r"ep-[0-9a-f]{16}")  # conversation.new_id's form: nothing else names a file here
_KEPT = 65_536  # episodes whose created / outcome fields are held in memory (the rest are read back)


class RewardExists(Exception):
    """The episode already has an outcome and the request did not ask to replace it."""

    def __init__(self, outcome: dict):
        super().__init__(outcome)
        self.outcome = outcome


class Recorder:
    def __init__(self, root: str | Path, max_bytes: int = 4096 * 2**20, log=print):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.log = max_bytes, log
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, dict] = OrderedDict()  # episode id -> created, outcome (no re-read per turn)
        sizes = [f.stat().st_size for f in self.root.glob("ep-*.json") if f.is_file()]
        self.episodes, self.bytes = len(sizes), sum(sizes)  # what the directory holds, earlier runs' included
        self.dropped = 0  # turns not recorded: the directory was full

    def stats(self) -> dict:
        return {"dir": str(self.root), "episodes": self.episodes, "bytes": self.bytes, "max_bytes": self.max_bytes,
                "dropped_turns": self.dropped}

    def path(self, episode_id: str) -> Path:
        return self.root / f"{episode_id}.json"

    def write(self, episode_id: str, ep: Episode, meta: dict) -> bool:
        """Record the episode as it stands; False when the directory's bound left it out."""
        with self._lock:
            kept = self._kept_fields(episode_id) or {"created": time.time(), "outcome": None}
            rec = {"kind": RECORD_KIND, "episode_id": episode_id, **meta, **record(ep, meta.get("temperature", 1.0)),
                   **kept}
            for r, t in zip(rec["turns"], ep.turns):
                r["admissible"] = t.admissible
            if not self._write(episode_id, rec, bounded=True):
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th ... : said, not flooded
                    self.log(f"{self.root} reached --max-record-bytes ({self.max_bytes:,} bytes): {self.dropped:,} "
                             "turns served but not recorded so far; collect what is there and record into a new "
                             "directory, or raise the bound")
                return False
            self._keep(episode_id, kept)
            return True

    def reward(self, episode_id: str, reward: float, won: bool | None, replace: bool = False) -> dict:
        """Close an episode with the client's reward (won: reward > 0 unless given). KeyError: no such
        episode; RewardExists: it has one and `replace` is not set."""
        with self._lock:
            p = self.path(episode_id)
            if not EPISODE_ID.fullmatch(episode_id) or not p.is_file():
                raise KeyError(episode_id)
            rec = json.loads(p.read_text())
            if rec.get("outcome") and not replace:
                raise RewardExists(rec["outcome"])
            rec["outcome"] = {"reward": float(reward), "won": bool(reward > 0) if won is None else bool(won),
                              "at": time.time()}
            self._write(episode_id, rec, bounded=False)  # an outcome is a few bytes: always written
            self._keep(episode_id, {"created": rec["created"], "outcome": rec["outcome"]})
            return rec["outcome"]

    def _kept_fields(self, episode_id: str) -> dict | None:
        if episode_id in self._kept:
            self._kept.move_to_end(episode_id)
            return self._kept[episode_id]
        if self.path(episode_id).is_file():  # recorded, but no longer held: read back
            rec = json.loads(self.path(episode_id).read_text())
            return {"created": rec["created"], "outcome": rec.get("outcome")}
        return None

    def _keep(self, episode_id: str, kept: dict) -> None:
        self._kept[episode_id] = kept
        self._kept.move_to_end(episode_id)
        while len(self._kept) > _KEPT:
            self._kept.popitem(last=False)

    def _write(self, episode_id: str, rec: dict, bounded: bool) -> bool:
        data = (json.dumps(rec) + "\n").encode()
        p = self.path(episode_id)
        old = p.stat().st_size if p.is_file() else None
        grown = self.bytes - (old or 0) + len(data)
        if bounded and grown > self.max_bytes:
            return False
        tmp = self.root / f".{episode_id}.json.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, p)
        self.bytes, self.episodes = grown, self.episodes + (old is None)
        return True
