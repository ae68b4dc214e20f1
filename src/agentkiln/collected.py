"""Collected splits (`agentkiln collect`): episodes the endpoint recorded, sealed into a versioned training
split, and read back by the stages that train on them.

    data/collected/<name>/episodes.jsonl   one recorded episode per line (serving.recorder's format:
                                           the ids as served, spans, behaviour log-probs, outcome)
    data/collected/<name>/manifest.json    written last: sha256 of every file, counts, who served them

A split is never overwritten (a new collection is a new name: versioned by construction), and nothing
is sealed unless every record passes the gate: a regular file inside the directory (no symbolic link),
a recorded episode by its schema (`RecordedEpisode`: types, finite numbers), token ids that are
integers inside the vocabulary (the record's `vocab_size`, or `--model`'s when given), spans, windows and
constrained choices that fit the ids, and with `--model`'s tokenizer each served reply's ids decoding to
its text; then the split's pandera contract (schemas.CollectedEpisodeSchema). A refusal names every bad
file and why. `load_split` applies the same record checks. A sealed split is `dvc add`ed when the
project uses DVC. Training reads it by params: `sft.data.collected` (its won episodes, rejection
sampling) and `rl.defaults.offline` (its rewarded episodes as an off-policy batch with their behaviour
log-probs). Either way the ids trained on are the ids served when the tokenizer is the same
(`tokenizer_digest`), and the episode is rendered again from its text otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentkiln.artifacts import ArtifactError, verify_manifest, write_manifest
from agentkiln.rollout.episode import Episode, from_record
from agentkiln.schemas import validate_collected

SPLIT_KIND = "agentkiln-collected-split"
SPLIT_FORMAT = 1
MANIFEST = "manifest.json"
EPISODES = "episodes.jsonl"
RECORD_KIND = "agentkiln-recorded-episode"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_RECORD_BYTES = 256 * 2**20  # one recorded episode file: the endpoint's limits keep them far smaller
_SHOWN = 20  # refused files named one by one, then counted


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class RecordedTurn(_Record):
    observation: str
    reply: str
    action: str
    reward: float
    invalid: bool
    tokens: int = Field(ge=0)
    advantage: float | None
    behaviour_logp: float
    trainer_logp: float | None
    window: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    guided: bool
    logprobs: list[float]
    allowed: list[list[int]] | None
    admissible: list[str] | None


class Outcome(_Record):
    reward: float
    won: bool
    at: float


class RecordedEpisode(_Record):
    """A recorded episode as serving.recorder writes it (rollout.episode.to_record plus who served it)."""

    kind: Literal["agentkiln-recorded-episode"]
    episode_id: str = Field(pattern=r"^ep-[0-9a-f]{16}$")
    model: str = Field(min_length=1)
    model_version: str = Field(min_length=1)
    retokenized: bool
    parent: str | None
    tokenizer: str = Field(min_length=16)
    vocab_size: int | None = Field(None, ge=1)  # absent from records made before it was recorded
    temperature: float = Field(gt=0)
    task_id: str
    family: str
    task_type: str
    group: int
    won: bool
    reward: float
    policy_version: int
    goal: str
    max_turns: int
    ids: list[int] = Field(min_length=2)
    prompt_len: int = Field(ge=1)
    windows: list[list[int]] = Field(min_length=1)
    turns: list[RecordedTurn] = Field(min_length=1)
    created: float
    outcome: Outcome | None


class RecordError(ValueError):
    """A record that must not be sealed; the message is the reason."""


def check_record(rec, policy=None, digest: str | None = None) -> RecordedEpisode:
    """`rec` (parsed JSON) as a valid recorded episode; RecordError saying why not. With `policy` (and its
    `digest`), ids are checked against its vocabulary and, for the episodes its tokenizer served, each
    served reply's ids against the reply's text."""
    if not isinstance(rec, dict):
        raise RecordError(f"a JSON {type(rec).__name__}, not a recorded episode (an object)")
    try:
        ep = RecordedEpisode.model_validate(rec)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"]).lstrip(".")
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise RecordError(f"{where or 'record'}: {err['msg']}{more}") from None
    same = policy is not None and ep.tokenizer == digest
    vocab = policy.vocab_size if same else ep.vocab_size
    n = len(ep.ids)
    bad = next((i for i in ep.ids if i < 0 or (vocab is not None and i >= vocab)), None)
    if bad is not None:
        raise RecordError(f"ids: token id {bad} is outside the vocabulary [0, {vocab if vocab is not None else 'n'})")
    if ep.prompt_len > n:
        raise RecordError(f"prompt_len {ep.prompt_len} is beyond the {n} ids")
    if ep.windows[0][0] != 0 or any(len(w) != 2 or not 0 <= w[0] <= w[1] <= n for w in ep.windows):
        raise RecordError("windows: each must be [start, stop] inside the ids, the first starting at 0")
    for k, t in enumerate(ep.turns):
        if t.window >= len(ep.windows) or not t.start <= t.end <= n:
            raise RecordError(f"turns[{k}]: its span [{t.start}, {t.end}) or window {t.window} is not in the episode")
        if t.allowed is not None:
            reply = ep.ids[t.start:t.end]
            if len(t.allowed) != len(reply) or any(i not in a for i, a in zip(reply, t.allowed)):
                raise RecordError(f"turns[{k}].allowed: a reply token is not among the tokens allowed at its step")
            if vocab is not None and any(i < 0 or i >= vocab for a in t.allowed for i in a):
                raise RecordError(f"turns[{k}].allowed: a token id outside the vocabulary [0, {vocab})")
    if same:
        _check_text(ep, policy)
    return ep


def _check_text(ep: RecordedEpisode, policy) -> None:
    """Each served reply's ids against its text: a free reply's ids decode to it; a constrained one's are
    the ids of its action (policies that call tools natively render actions with the request's tools,
    which are not recorded: only their tokens' choices are checked)."""
    from agentkiln.policy.prompt import render_action  # noqa: PLC0415  (only with --model)

    for k, t in enumerate(ep.turns):
        ids = ep.ids[t.start:t.end]
        if not t.logprobs:
            continue  # a turn re-tokenized from text: not served
        if t.allowed is None:
            ok = policy.chat.decode(ids) == t.reply
        elif policy.fmt.native_tools:
            ok = True
        else:
            ok = ids == policy.chat.reply(render_action(policy.fmt, t.reply, None))
        if not ok:
            raise RecordError(f"turns[{k}]: its ids are not the ids of its reply text {t.reply[:40]!r} under "
                              f"{policy.source}'s tokenizer")


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


def read_recorded(record_dir: str | Path, policy=None) -> list[dict]:
    """Every recorded episode in `record_dir` (ep-*.json), each checked (`check_record`; with `policy`,
    against its tokenizer); an ArtifactError naming every file that is not one, and why."""
    record_dir = Path(record_dir)
    if not record_dir.is_dir():
        raise FileNotFoundError(f"{record_dir}: no such directory; give the --record directory of `agentkiln endpoint`")
    digest = tokenizer_digest(policy) if policy is not None else None
    out, refused = [], []
    with os.scandir(record_dir) as entries:
        files = sorted((e for e in entries if re.fullmatch(r"ep-.*\.json", e.name)), key=lambda e: e.name)
    for entry in files:
        try:
            out.append(check_record(_read_record(entry), policy, digest).model_dump())
        except RecordError as e:
            refused.append(f"{entry.name}: {e}")
    if refused:
        shown = "\n".join(f"  - {r}" for r in refused[:_SHOWN])
        more = f"\n  ... and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else ""
        raise ArtifactError(f"{record_dir}: {len(refused)} of {len(files)} files are not valid recorded episodes, so "
                            f"nothing was collected:\n{shown}{more}\nremove or move them out of the directory (or "
                            "record again), then collect")
    if not out:
        raise FileNotFoundError(f"{record_dir}: no recorded episodes (ep-*.json); serve with "
                                "`agentkiln endpoint --record DIR` and play some episodes first")
    return out


def _read_record(entry: os.DirEntry):
    """A record file's JSON: a regular file of this directory only (a link could point anywhere)."""
    if entry.is_symlink():
        raise RecordError(f"a symbolic link (to {os.readlink(entry.path)}): only regular files inside the "
                          "directory are collected")
    if not entry.is_file(follow_symlinks=False):
        raise RecordError("not a regular file")
    size = entry.stat(follow_symlinks=False).st_size
    if size > MAX_RECORD_BYTES:
        raise RecordError(f"{size:,} bytes, more than a recorded episode can be ({MAX_RECORD_BYTES:,})")
    fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # no link swapped in since the check
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RecordError("not UTF-8 text") from None
    except RecursionError:
        raise RecordError("JSON nested too deeply") from None
    except ValueError as e:
        raise RecordError(f"not JSON ({e})") from None


def collect(record_dir: str | Path, out_root: str | Path, name: str, rewarded_only: bool = False,
            dvc: bool = True, log=print, model: str | Path | None = None) -> Path:
    """Seal the episodes recorded in `record_dir` as the split `out_root/name`; its directory. Nothing is
    written unless every record passes the gate (`read_recorded`; `model`: a policy directory whose
    tokenizer the ids are checked against)."""
    if not NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: letters, digits, '.', '_' and '-' (at most 64), e.g. harness-2026-11-27")
    out = Path(out_root) / name
    if out.exists():
        raise FileExistsError(f"{out}: exists; a collected split is never overwritten (its models' lineage names it): "
                              "choose a new --name (e.g. add -v2)")
    policy = None
    if model is not None:
        from agentkiln.policy.model import load_policy  # noqa: PLC0415  (torch: only when asked)

        policy = load_policy(model)
    records = read_recorded(record_dir, policy)
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
    records = []
    for k, line in enumerate((split / EPISODES).read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(check_record(json.loads(line)).model_dump())
            except (RecordError, ValueError, RecursionError) as e:
                raise ArtifactError(f"{split / EPISODES}: line {k} is not a valid recorded episode ({e}); collect the "
                                    "recorded episodes again under a new name") from None
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
