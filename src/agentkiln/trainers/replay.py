"""Re-score logged training episodes under another checkpoint (`agentkiln replay`).

An RL iteration logs a sample of its episodes (trainers.episode_log) with the token ids they were
generated as: an MLflow artifact episodes/iteration_NNNN.json per iteration, and the stage's
reports/rl/<stage>/episodes.jsonl with every iteration's. A replay rebuilds each episode's token
sequence from its ids (never re-tokenising its text), takes every reply's log-prob under the given
policy exactly as the trainer does (same windows, temperature and constrained-decoding choices), and
sets it beside the behaviour log-prob logged when it was played: how far a later checkpoint moved on
the very replies it was trained on (the replay of iteration 1 under the starting model gives back
the behaviour log-probs, up to the KV cache's float error).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agentkiln.policy import Policy
from agentkiln.trainers import episode_log
from agentkiln.trainers.batch import build_batch
from agentkiln.trainers.rl import score


class ReplayError(ValueError):
    """A file that holds no logged episodes, or a policy that cannot score them."""


def load_records(path: str | Path, iteration: int | None = None) -> list[tuple[int, dict]]:
    """(iteration, record) of every logged episode in `path`: an MLflow artifact
    ({"iteration", "episodes"}) or a stage's episodes.jsonl (one such object per line);
    `iteration`: only that iteration's."""
    path = Path(path)
    if not path.is_file():
        raise ReplayError(f"{path}: no such file; give an RL stage's reports/rl/<stage>/episodes.jsonl or an MLflow "
                          "run's episodes/iteration_NNNN.json artifact")
    try:
        text = path.read_text()
        blocks = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(text)]
        out = [(int(b["iteration"]), rec) for b in blocks for rec in b["episodes"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{path}: not a log of training episodes ({e}); it is written by the rl stage "
                          "(rl.log_episodes > 0)") from e
    if any("ids" not in rec for _, rec in out):
        raise ReplayError(f"{path}: its episodes carry no token ids (logged by an older agentkiln); re-run the rl "
                          "stage to log replayable episodes")
    if iteration is not None:
        found = sorted({it for it, _ in out})
        out = [(it, rec) for it, rec in out if it == iteration]
        if not out:
            raise ReplayError(f"{path}: no episodes of iteration {iteration} (logged: {found})")
    return out


def rescore(policy: Policy, rec: dict) -> list[float]:
    """Each turn's reply log-prob (summed over its tokens) under `policy`, as the trainer takes it."""
    ep = episode_log.episode(rec)
    vocab = policy.model.get_input_embeddings().num_embeddings
    if ep.ids and max(ep.ids) >= vocab:
        raise ReplayError(f"episode {rec['task_id']}: token id {max(ep.ids)} is outside the policy's vocabulary "
                          f"({vocab}); replay it under a checkpoint of the same model")
    batch = build_batch([ep], policy.pad_id)
    logp = score(policy, batch, rec.get("temperature", 1.0), rows_per_pass=max(1, batch.rows))
    sums = episode_log.per_turn_sum(batch, logp, torch.float64)
    out = [0.0] * len(ep.turns)
    for i, (_, k) in enumerate(batch.turns):
        out[k] = float(sums[i])
    return out


def replay(policy: Policy, records: list[tuple[int, dict]]) -> list[dict]:
    """One row per turn of every record: its reply, advantage, behaviour and replayed log-probs."""
    rows = []
    for it, rec in records:
        replayed = rescore(policy, rec)
        for k, (t, lp) in enumerate(zip(rec["turns"], replayed)):
            rows.append({"iteration": it, "task_id": rec["task_id"], "won": rec["won"], "turn": k + 1,
                         "reply": t["reply"], "tokens": t["tokens"], "advantage": t["advantage"],
                         "behaviour_logp": t["behaviour_logp"], "replayed_logp": round(lp, 6),
                         "delta": round(lp - t["behaviour_logp"], 6)})
    return rows


def table(rows: list[dict]) -> str:
    """The replay as a plain-text table, and how the replayed log-probs moved where advantages were
    positive and where they were negative (what the update should have done)."""
    lines = [f"{'it':>3} {'task':<28} {'turn':>4} {'adv':>7} {'behaviour':>10} {'replayed':>10} {'delta':>8}  reply"]
    for r in rows:
        adv = "-" if r["advantage"] is None else f"{r['advantage']:+.3f}"
        reply = r["reply"].replace("\n", " ")
        lines.append(f"{r['iteration']:>3} {r['task_id'][:28]:<28} {r['turn']:>4} {adv:>7} {r['behaviour_logp']:>10.4f} "
                     f"{r['replayed_logp']:>10.4f} {r['delta']:>+8.4f}  {reply[:60]}")
    for sign, name in ((1, "positive"), (-1, "negative")):
        d = [r["delta"] for r in rows if r["advantage"] is not None and r["advantage"] * sign > 0]
        if d:
            lines.append(f"turns with {name} advantage: {len(d)}, mean log-prob change {sum(d) / len(d):+.4f}")
    return "\n".join(lines)
