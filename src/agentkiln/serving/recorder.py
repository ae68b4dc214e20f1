"""Token-in/token-out recording: with `agentkiln endpoint --record DIR` every conversation the endpoint
serves is kept as an episode, one JSON file per episode (`DIR/<episode id>.json`), rewritten after
each served turn: the record format of logged training episodes (trainers.episode_log: the ids as
served, each reply's span, per-token behaviour log-probs and constrained-decoding choices), plus who
served it and its outcome, which the client posts (`POST /v1/episodes/{id}/reward`) or leaves unset.
Files are replaced atomically: a reader never sees half an episode.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from agentkiln.rollout.episode import Episode
from agentkiln.collected import RECORD_KIND
from agentkiln.rollout.episode import to_record as record



class Recorder:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._kept: dict[str, dict] = {}  # episode id -> what a rewrite keeps: created, outcome (no re-read per turn)

    def path(self, episode_id: str) -> Path:
        return self.root / f"{episode_id}.json"

    def write(self, episode_id: str, ep: Episode, meta: dict) -> None:
        with self._lock:
            kept = self._kept.setdefault(episode_id, {"created": time.time(), "outcome": None})
            rec = {"kind": RECORD_KIND, "episode_id": episode_id, **meta, **record(ep, meta.get("temperature", 1.0)),
                   **kept}
            for r, t in zip(rec["turns"], ep.turns):
                r["admissible"] = t.admissible
            self._write(episode_id, rec)

    def reward(self, episode_id: str, reward: float, won: bool | None) -> dict:
        """Close an episode with the client's reward (won: reward > 0 unless given)."""
        with self._lock:
            rec = self._read(episode_id)
            if not rec:
                raise KeyError(episode_id)
            rec["outcome"] = {"reward": float(reward), "won": bool(reward > 0) if won is None else bool(won),
                              "at": time.time()}
            self._kept[episode_id] = {"created": rec["created"], "outcome": rec["outcome"]}
            self._write(episode_id, rec)
            return rec["outcome"]

    def _read(self, episode_id: str) -> dict:
        p = self.path(episode_id)
        return json.loads(p.read_text()) if p.is_file() else {}

    def _write(self, episode_id: str, rec: dict) -> None:
        tmp = self.root / f".{episode_id}.json.tmp"
        tmp.write_text(json.dumps(rec) + "\n")
        os.replace(tmp, self.path(episode_id))
