"""What the trainer saw: a sample of an RL iteration's episodes as plain data (an MLflow artifact per
iteration, tracking.log_episodes), turn by turn: the observation, the reply and the action it parsed
to, the turn's reward, its advantage (mean over the reply's tokens, as trained), the behaviour
log-prob of the reply (the engine that sampled it) and the trainer's (recomputed under its weights,
when it was: vLLM or asynchronous rollouts), and the policy version that played the episode. A record
also keeps the episode's token ids as generated (its windows, each reply's span, per-token behaviour
log-probs and constrained-decoding choices), so `episode(record)` rebuilds the very sequence the
trainer saw and trainers.replay can re-score it under another checkpoint without re-tokenising."""

from __future__ import annotations

import torch

from agentkiln.rollout.episode import Episode
from agentkiln.rollout.episode import from_record as episode  # noqa: F401  (the log's readers: replay, the viewer)
from agentkiln.rollout.episode import to_record as record
from agentkiln.trainers.batch import Batch


def per_turn_sum(batch: Batch, column: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [R, T] column summed over each turn's reply tokens, in the order of `batch.turns`."""
    return torch.zeros(len(batch.turns), dtype=dtype).index_add(0, batch.flat(batch.turn_index),
                                                               batch.flat(column).to(dtype))


def annotate(batch: Batch, episodes: list[Episode], trainer_logp: torch.Tensor | None = None,
             kept_only: bool = False) -> None:
    """Write each turn's mean token advantage (and summed recomputed log-prob) onto the episode's turns;
    `kept_only`: the batch is a selection of rows, and turns of the rows it dropped keep theirs."""
    counts = per_turn_sum(batch, batch.loss_mask)
    adv = per_turn_sum(batch, batch.advantages) / counts.clamp(min=1)
    lp = None if trainer_logp is None else per_turn_sum(batch, trainer_logp)
    for i, (e, k) in enumerate(batch.turns):
        if kept_only and counts[i] == 0:
            continue
        turn = episodes[e].turns[k]
        turn.advantage = float(adv[i])
        if lp is not None:
            turn.trainer_logp = float(lp[i])


def sample(episodes: list[Episode], k: int, temperature: float = 1.0) -> list[dict]:
    """The first episode of each of the first `k` groups (deterministic), as plain data; `temperature`:
    the one its log-probs were taken at (a replay scores at the same)."""
    seen, out = set(), []
    for ep in episodes:
        if ep.group in seen:
            continue
        seen.add(ep.group)
        out.append(record(ep, temperature))
        if len(out) >= k:
            break
    return out
