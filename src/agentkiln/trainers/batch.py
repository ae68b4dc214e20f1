"""Turn (prompt ids, reply ids) samples into padded tensors and score the reply tokens.

The loss only ever touches reply (action) tokens: prompt and observation tokens are inputs, never
targets. `allowed` carries the constrained-decoding mask of each reply token; when given, log-probs
are taken under that mask, i.e. under the distribution the rollout actually sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    reply_ids: list[int]
    allowed: list[list[int]] | None = None  # per reply token; None = full vocabulary (SFT)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [N] sample index of each reply token
    cols: torch.Tensor  # [N] position whose logits predict that token
    targets: torch.Tensor  # [N]
    allowed: torch.Tensor | None  # [N, V] bool


def make_batch(samples: list[Sample], pad_id: int, vocab_size: int) -> TokenBatch:
    seqs = [s.prompt_ids + s.reply_ids for s in samples]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    rows, cols, targets, masks = [], [], [], []
    constrained = all(s.allowed is not None for s in samples)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention[b, : len(seq)] = 1
        start = len(s.prompt_ids)
        for j, tok in enumerate(s.reply_ids):
            rows.append(b)
            cols.append(start + j - 1)  # logits at position p predict token p + 1
            targets.append(tok)
            if constrained:
                m = torch.zeros(vocab_size, dtype=torch.bool)
                m[s.allowed[j]] = True
                masks.append(m)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention,
        rows=torch.tensor(rows),
        cols=torch.tensor(cols),
        targets=torch.tensor(targets),
        allowed=torch.stack(masks) if constrained else None,
    )


def reply_logprobs(model, batch: TokenBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every reply token, [N] each (under the mask when there is one)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[batch.rows, batch.cols].float() / temperature
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, float("-inf"))
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, batch.targets[:, None]).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp, entropy
