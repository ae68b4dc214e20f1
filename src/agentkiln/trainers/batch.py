"""Episodes -> one flat batch of tensors, and the log-probs of its reply tokens under a model.

    rows        one per episode window (usually one per episode), right-padded to the longest
    input_ids   [R, T]   the window's ids, exactly as generated and appended
    loss_mask   [R, T]   True at reply tokens (the only positions with loss; logits at t-1 predict t)
    old_logp    [R, T]   behaviour log-prob of each reply token (what the rollout sampled with)
    allowed     [R, T, K] constrained decoding: the ids allowed at each reply token (-1 pads; K=0: none)
    turn_index  [R, T]   which turn (index into `turns`) each reply token belongs to, -1 elsewhere
    episode     [R]      which episode each row belongs to
    advantages, ref_logp, values [R, T]: filled by credit assignment / the reference model
    lag         [R]      optimizer steps from the behaviour policy to the proximal one (asynchronous RL's
                         loglinear proximal policy; None: the old log-probs are the proximal policy's)

Every column is built once per iteration, on the CPU; losses read columns and minibatches slice
rows; a minibatch moves to the model's device (`to`) right before its forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from agentkiln.rollout.episode import Episode


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    allowed: torch.Tensor
    turn_index: torch.Tensor
    episode: torch.Tensor
    turns: list[tuple[int, int]]  # (episode, turn) of every turn index
    advantages: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    lag: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, rows: list[int] | torch.Tensor) -> Batch:
        """A minibatch of rows (columns trimmed to its longest row)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[idx].sum(1).max()) if len(idx) else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v[idx]
                if v.dim() >= 2 and f.name != "episode":
                    v = v[:, :width]
            out[f.name] = v
        return replace(self, **out)

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on `device` (itself when already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def flat(self, column: torch.Tensor) -> torch.Tensor:
        """A [R, T] column at the reply tokens, row-major: each episode's tokens in the order played."""
        return column[self.loss_mask]

    def seq_ids(self) -> torch.Tensor:
        """The episode of every reply token (the "sequence" of sequence-level loss aggregations)."""
        return self.episode[:, None].expand_as(self.loss_mask)[self.loss_mask]


def build_batch(episodes: list[Episode], pad_id: int, keep_turn=None) -> Batch:
    """One row per window of every episode; `keep_turn(e, t) -> bool` drops turns from the loss
    (their tokens stay as context). Rows without a trained token are left out."""
    rows: list[tuple[int, int]] = []
    turns: list[tuple[int, int]] = []
    for e, ep in enumerate(episodes):
        for w in range(len(ep.windows)):
            if any(t.window == w and t.end > t.start and (keep_turn is None or keep_turn(e, k))
                   for k, t in enumerate(ep.turns)):
                rows.append((e, w))
    width = max((episodes[e].window_len(w) for e, w in rows), default=0)
    k_max = max((len(a) for ep in episodes for t in ep.turns for a in (t.allowed or [])), default=0)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss = torch.zeros((n, width), dtype=torch.bool)
    old = torch.zeros((n, width))
    allowed = torch.full((n, width, k_max), -1, dtype=torch.long)
    turn_index = torch.full((n, width), -1, dtype=torch.long)
    index: dict[tuple[int, int], int] = {}
    for r, (e, w) in enumerate(rows):
        ep = episodes[e]
        row = ep.window_ids(w)
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
        off = ep.window_offset(w)
        for k, t in enumerate(ep.turns):
            if t.window != w or t.end == t.start or (keep_turn is not None and not keep_turn(e, k)):
                continue
            if (e, k) not in index:
                index[e, k] = len(turns)
                turns.append((e, k))
            span = slice(t.start + off, t.end + off)
            loss[r, span] = True
            turn_index[r, span] = index[e, k]
            if t.logprobs:
                old[r, span] = torch.tensor(t.logprobs)
            for j, a in enumerate(t.allowed or []):
                allowed[r, t.start + off + j, : len(a)] = torch.tensor(a)
    return Batch(ids, attn, loss, old, allowed, turn_index, torch.tensor([e for e, _ in rows], dtype=torch.long), turns)


# --------------------------------------------------------------------------- scoring
def hidden_at(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """Final hidden states [N, H] at `positions` ([N, 2]: row, column) from one forward of the decoder.
    Rows are right-padded, so plain causal attention is exact for every real token (pads come after
    it and are never attended to): no padding mask is passed, which lets SDPA use its fused causal
    kernel (~40% faster on CPU). `attention_mask` only trims the batch to its longest row."""
    decoder = model.get_decoder()
    device = next(model.parameters()).device
    width = int(attention_mask.sum(1).max())
    out = decoder(input_ids=input_ids[:, :width].to(device), use_cache=False)
    positions = positions.to(device)
    return out.last_hidden_state[positions[:, 0], positions[:, 1]]


def allowed_mask(batch: Batch, vocab: int) -> torch.Tensor | None:
    """[N, V] bool at the reply tokens: the ids constrained decoding allowed (every id where decoding
    was free); None when nothing in the batch was constrained."""
    if not batch.allowed.shape[-1]:
        return None
    allowed = batch.allowed[batch.loss_mask]
    keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=allowed.device)
    free = allowed[:, 0] < 0
    if bool(free.all()):
        return None
    keep[free] = True
    rows = (~free).nonzero().squeeze(-1)
    sub = allowed[rows]
    keep[rows[:, None].expand_as(sub)[sub >= 0], sub[sub >= 0]] = True
    return keep


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of every reply token, flat [N] in `batch.flat` order, under the
    distribution the rollout sampled from: the whole vocabulary, or the allowed ids where decoding
    was constrained. The LM head runs only at the N positions that predict a reply token (at a 152k
    vocabulary the full [R, T, V] logits would dominate memory). Runs on the model's device."""
    batch = batch.to(next(model.parameters()).device)
    pred = batch.loss_mask.nonzero()
    pred[:, 1] -= 1  # logits at t-1 predict token t
    h = hidden_at(model, batch.input_ids, batch.attention_mask, pred)
    logits = model.get_output_embeddings()(h).float() / temperature
    keep = allowed_mask(batch, logits.shape[-1])
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, batch.flat(batch.input_ids)[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp, entropy
