"""Collected splits (`agentkiln collect`): episodes the endpoint recorded, sealed into a versioned training
split, and read back by the stages that train on them.

    data/collected/<name>/episodes.jsonl   one recorded episode per line (serving.recorder's format:
                                           the ids as served, spans, behaviour log-probs, outcome)
    data/collected/<name>/manifest.json    written last: sha256 of every file, counts, who served them

A split is never overwritten (a new collection is a new name: versioned by construction), is checked
against a pandera contract (schemas.CollectedEpisodeSchema) before it is sealed, and `dvc add`ed when
the project uses DVC. Training reads it by params: `sft.data.collected` (its won episodes, rejection
sampling) and `rl.defaults.offline` (its rewarded episodes as an off-policy batch with their behaviour
log-probs). Either way the ids trained on are the ids served when the tokenizer is the same
(`tokenizer_digest`), and the episode is rendered again from its text otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pandas as pd

from agentkiln.artifacts import ArtifactError, verify_manifest, write_manifest
from agentkiln.rollout.episode import Episode, from_record
from agentkiln.schemas import validate_collected

SPLIT_KIND = "agentkiln-collected-split"
SPLIT_FORMAT = 1
MANIFEST = "manifest.json"
EPISODES = "episodes.jsonl"
RECORD_KIND = "agentkiln-recorded-episode"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def tokenizer_digest(policy) -> str:
    """What decides the ids of a conversation: vocabulary, chat template, agent format, context."""
    vocab = sorted(policy.tokenizer.get_vocab().items())
    blob = json.dumps([vocab, policy.tokenizer.chat_template, policy.fmt.to_dict(), policy.max_context])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _spans_ok(rec: dict) -> bool:
    """Every reply's span lies inside the ids with one log-prob per token, or none for a turn re-tokenised
    from text (a retokenized episode's history); the last reply was served, so it has them all."""
    n = len(rec["ids"])
    turns = rec["turns"]
    inside = all(0 <= t["start"] <= t["end"] <= n and len(t["logprobs"]) in (0, t["end"] - t["start"]) for t in turns)
    return inside and len(turns[-1]["logprobs"]) == turns[-1]["end"] - turns[-1]["start"]


def _row(rec: dict) -> dict:
    outcome = rec.get("outcome") or {}
    return {"episode_id": rec["episode_id"], "task_id": rec["task_id"], "family": rec["family"],
            "model": rec["model"], "model_version": str(rec["model_version"]), "tokenizer": rec["tokenizer"],
            "turns": len(rec["turns"]), "n_ids": len(rec["ids"]), "rewarded": bool(outcome),
            "reward": outcome.get("reward"), "won": outcome.get("won"), "retokenized": bool(rec["retokenized"]),
            "spans_ok": _spans_ok(rec)}


def table(records: list[dict], source: str) -> pd.DataFrame:
    df = pd.DataFrame([_row(r) for r in records])
    df["reward"] = df["reward"].astype("float64")
    df["won"] = df["won"].astype("boolean")
    return validate_collected(df, source)


def read_recorded(record_dir: str | Path) -> list[dict]:
    """Every recorded episode in `record_dir`, by episode id; a file that is not one is named."""
    record_dir = Path(record_dir)
    if not record_dir.is_dir():
        raise FileNotFoundError(f"{record_dir}: no such directory; give the --record directory of `agentkiln endpoint`")
    out = []
    for f in sorted(record_dir.glob("ep-*.json")):
        try:
            rec = json.loads(f.read_text())
            if rec.get("kind") != RECORD_KIND:
                raise ValueError(f"kind {rec.get('kind')!r}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{f}: not a recorded episode ({e}); remove it or record again") from e
        out.append(rec)
    if not out:
        raise FileNotFoundError(f"{record_dir}: no recorded episodes (ep-*.json); serve with "
                                "`agentkiln endpoint --record DIR` and play some episodes first")
    return out


def collect(record_dir: str | Path, out_root: str | Path, name: str, rewarded_only: bool = False,
            dvc: bool = True, log=print) -> Path:
    """Seal the episodes recorded in `record_dir` as the split `out_root/name`; its directory."""
    if not NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: letters, digits, '.', '_' and '-' (at most 64), e.g. harness-2026-11-27")
    out = Path(out_root) / name
    if out.exists():
        raise FileExistsError(f"{out}: exists; a collected split is never overwritten (its models' lineage names it): "
                              "choose a new --name (e.g. add -v2)")
    records = read_recorded(record_dir)
    df = table(records, str(record_dir))
    if rewarded_only:
        keep = set(df.loc[df["rewarded"], "episode_id"])
        records = [r for r in records if r["episode_id"] in keep]
        if not records:
            raise ValueError(f"{record_dir}: no episode was rewarded (POST /v1/episodes/<id>/reward); "
                             "collect without --rewarded-only to keep them all")
        df = df[df["rewarded"]]
    out.mkdir(parents=True)
    with open(out / EPISODES, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    meta = {"name": name, "episodes": len(df), "rewarded": int(df["rewarded"].sum()),
            "won": int(df["won"].fillna(False).sum()), "retokenized": int(df["retokenized"].sum()),
            "served_by": {f"{m}#{v}": int(n) for (m, v), n in df.groupby(["model", "model_version"]).size().items()}}
    write_manifest(out, MANIFEST, SPLIT_KIND, SPLIT_FORMAT, meta)
    log(f"sealed {len(df)} episodes ({meta['rewarded']} rewarded, {meta['won']} won) as {out} "
        f"(digest {split_digest(out)})")
    if dvc and _dvc_project(out):
        res = subprocess.run(["dvc", "add", str(out)], cwd=_dvc_project(out), capture_output=True, text=True)
        if res.returncode != 0:
            log(f"dvc add {out} failed ({res.stderr.strip()[-300:]}); the split is sealed, track it by hand")
        else:
            log(f"tracked by DVC: git add {out}.dvc && git commit, then dvc push")
    log(f"train on it: sft.data.collected: {out} (won episodes) or rl.defaults.offline.split: {out}")
    return out


def _dvc_project(path: Path) -> Path | None:
    for p in [path.resolve(), *path.resolve().parents]:
        if (p / ".dvc").is_dir():
            return p
    return None


def split_digest(split: str | Path) -> str:
    return hashlib.sha256((Path(split) / MANIFEST).read_bytes()).hexdigest()[:16]


def load_split(split: str | Path, what: str) -> list[dict]:
    """The records of a sealed split, after its manifest's checks; `what` names the setting that asked."""
    split = Path(split)
    if not (split / MANIFEST).is_file():
        raise FileNotFoundError(f"{what}: {split} is not a collected split (no {MANIFEST}); make one with "
                                "`agentkiln collect RECORD_DIR --name NAME`, or set it to null")
    verify_manifest(split, MANIFEST, SPLIT_KIND, SPLIT_FORMAT, required=(EPISODES,),
                    hint="collect the recorded episodes again under a new name")
    records = [json.loads(line) for line in (split / EPISODES).read_text().splitlines() if line.strip()]
    table(records, str(split / EPISODES))
    return records


def as_episode(rec: dict) -> Episode:
    """A recorded episode with its ids as served and its outcome (won / reward at its last turn)."""
    ep = from_record(rec)
    outcome = rec.get("outcome") or {}
    ep.won = bool(outcome.get("won", False))
    for t, r in zip(ep.turns, rec["turns"]):
        t.admissible = r.get("admissible")
        t.reward = 0.0
    if ep.turns and outcome:
        ep.turns[-1].reward = float(outcome["reward"])
    return ep


def training_episodes(records: list[dict], policy, won_only: bool) -> tuple[list[Episode], list[Episode]]:
    """(episodes whose ids the policy trains on as served, episodes to render again from text)."""
    def wanted(r: dict) -> bool:
        o = r.get("outcome")
        return bool(o) and (bool(o["won"]) if won_only else not r["retokenized"])  # RL needs every behaviour log-prob

    keep = [r for r in records if wanted(r)]
    digest = tokenizer_digest(policy)
    same = [as_episode(r) for r in keep if r["tokenizer"] == digest and not r["retokenized"]]
    other = [as_episode(r) for r in keep if r["tokenizer"] != digest or r["retokenized"]]
    return same, other
