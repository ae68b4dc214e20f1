"""KV caches over a batch of conversations that grow at different speeds.

Each row is one episode's current window. Every turn the rows receive different numbers of new
tokens (an observation, then the reply decoded token by token), so new tokens are written as one
block per call, each row's tokens right-aligned in it and the gap masked out; RoPE positions are
each row's own. Rows live in groups of similar shape (`plan_groups`), each with its own cache: a
forward pass pads a row only up to the widest block and longest row of its group (attention over a
1,500-token episode next to a 300-token one would otherwise cost the short one five times over), and
a group with nothing to compute is skipped. When finished rows, masked gaps or a restarted window
make a group wasteful, `prepare` repacks: every live row's real slots are gathered, right-aligned,
into new groups. Keys are stored after the rotary embedding, so moving a slot does not change what
it means.

Buffers grow by doubling (`_SlotLayer`): a decoding step writes in place instead of copying the
whole cache as transformers' DynamicCache does (torch.cat per step).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

CALL_TOKENS = 256  # the fixed cost of one forward call, in tokens' worth of linear layers
REPACK_WASTE = 0.3  # repack when this share of a group's cached slots (dead rows, gaps) is waste


def plan_groups(new: list[int], cached: list[int], hidden: int) -> list[list[int]]:
    """Partition rows into groups that minimise padded work: a group costs its rows x its widest
    block x (the linear layers of a token + attention over its longest row), plus a fixed call cost.
    Rows are taken widest block first, then longest cache; each joins the last group or opens a new
    one, whichever costs less (a restarted window's 600-token block does not pad 70-token ones)."""
    lin, att = 24 * hidden * hidden, 4 * hidden  # per-layer FLOPs of a token, of a token x key

    def cost(n: int, w: int, s: int) -> float:
        return n * w * (lin + att * (s + w)) + CALL_TOKENS * lin

    order = sorted(range(len(new)), key=lambda j: (-new[j].bit_length(), -cached[j], -new[j]))
    groups: list[list[int]] = []
    shape: list[tuple[int, int]] = []  # (widest block, longest cache) of each group
    for j in order:
        if groups:
            w, s = shape[-1]
            w2, s2 = max(w, new[j]), max(s, cached[j])
            n = len(groups[-1])
            if cost(n + 1, w2, s2) <= cost(n, w, s) + cost(1, new[j], cached[j]):
                groups[-1].append(j)
                shape[-1] = (w2, s2)
                continue
        groups.append([j])
        shape.append((new[j], cached[j]))
    return groups


class _SlotLayer(DynamicLayer):
    """One layer's keys/values: preallocated buffers, `n` slots in use."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.n = 0
        self._k = self._v = None
        self.is_initialized = True

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        """Take `keys`/`values` [B, H, capacity, D] as the buffers, the first `used` slots filled."""
        self.dtype, self.device = keys.dtype, keys.device
        self._k, self._v, self.n = keys, values, used
        self.keys, self.values = keys[:, :, :used], values[:, :, :used]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        device = key_states.device.type
        if torch.is_autocast_enabled(device):
            # kept in the autocast dtype: attention casts them to it on every call anyway (the same numbers),
            # and a bf16 cache is half the memory to hold and read (a decoding step ~25% faster on a CPU)
            dtype = torch.get_autocast_dtype(device)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._k is None or self.n + new > self._k.shape[-2]:
            cap = self.n + max(new, self.n, 64)
            k = key_states.new_zeros(key_states.shape[0], key_states.shape[1], cap, key_states.shape[3])
            v = value_states.new_zeros(value_states.shape[0], value_states.shape[1], cap, value_states.shape[3])
            if self._k is not None:
                k[:, :, : self.n] = self._k[:, :, : self.n]
                v[:, :, : self.n] = self._v[:, :, : self.n]
            self._k, self._v = k, v
        self._k[:, :, self.n : self.n + new] = key_states
        self._v[:, :, self.n : self.n + new] = value_states
        self.n += new
        self.keys, self.values = self._k[:, :, : self.n], self._v[:, :, : self.n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def expand(self, index: torch.Tensor) -> None:
        """Row i takes the slots of row index[i] (rows that were computed once for several)."""
        self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        self.keys, self.values = self._k[:, :, : self.n], self._v[:, :, : self.n]


class _Group:
    """Rows sharing one cache: `mask` [b, S] marks real slots, `pos` each row's next RoPE position."""

    def __init__(self, rows: list[int], device, width: int = 0):
        self.rows = rows  # the KVRows row of each member
        self.cache: Cache | None = None
        self.mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        self.pos = [0] * len(rows)


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` from transformers 5.24 on, where
    `past_key_values` is deprecated (warned on every call: a flooded log) and goes in 5.40."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA (peft)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class KVRows:
    """Incremental forward passes over rows of token sequences (caches per group of similar rows).
    Row ids are fixed at construction; `prepare` names the live ones before each turn."""

    def __init__(self, model: torch.nn.Module, pad_id: int, rows: int):
        self.model, self.pad_id = model, pad_id
        self.cache_arg = cache_argument(model)
        self.device = next(model.parameters()).device
        self.hidden = int(model.config.get_text_config().hidden_size)
        self.groups = [_Group(list(range(rows)), self.device)]
        self.where = {r: (0, r) for r in range(rows)}  # live row -> (group, index in group)
        self.restarted: set[int] = set()

    def restart(self, row: int) -> None:
        """Forget a row's tokens (its episode starts a new window)."""
        g, i = self.where[row]
        self.groups[g].mask[i] = 0
        self.groups[g].pos[i] = 0
        self.restarted.add(row)

    def prepare(self, live: list[int], new_tokens: list[int], room: int = 64) -> None:
        """Only `live` rows go on (each about to be fed `new_tokens`); repack them into new groups
        when dead rows, masked gaps or restarted windows waste more than REPACK_WASTE of a group."""
        live_set = set(live)
        for r in [r for r in self.where if r not in live_set]:
            g, i = self.where.pop(r)
            self.groups[g].mask[i] = 0
        wasteful = bool(self.restarted) or any(
            g.mask.numel() and 1 - float(g.mask.sum()) / g.mask.numel() > REPACK_WASTE for g in self.groups)
        self.restarted.clear()
        if wasteful:
            self._repack(live, new_tokens, room)
        self.groups = [g for g in self.groups if any(r in self.where for r in g.rows)]
        self.where = {r: (gi, i) for gi, g in enumerate(self.groups) for i, r in enumerate(g.rows) if r in live_set}

    def _repack(self, live: list[int], new_tokens: list[int], room: int) -> None:
        cached = {r: int(self.groups[self.where[r][0]].mask[self.where[r][1]].sum()) for r in live}
        groups = []
        for members in plan_groups(new_tokens, [cached[r] for r in live], self.hidden):
            rows = [live[j] for j in members]
            width = max(cached[r] for r in rows)
            group = _Group(rows, self.device, width)
            for m, r in enumerate(rows):
                g, i = self.where[r]
                group.mask[m, width - cached[r]:] = 1
                group.pos[m] = self.groups[g].pos[i]
            sources = sorted({self.where[r][0] for r in rows if cached[r]})
            layers: list[_SlotLayer] = []
            for g in sources:  # copy each source group's rows at once: real slots right-aligned
                src = self.groups[g]
                pairs = [(m, self.where[r][1]) for m, r in enumerate(rows) if self.where[r][0] == g and cached[r]]
                dst = torch.tensor([m for m, _ in pairs], device=self.device)
                idx = torch.tensor([i for _, i in pairs], device=self.device)
                mask = src.mask.index_select(0, idx)
                cm = int(mask.sum(1).max())
                order = torch.sort(mask, dim=1, stable=True).indices[:, mask.shape[1] - cm:]
                if not layers:
                    for s_layer in src.cache.layers:
                        k, v = s_layer.keys, s_layer.values
                        layer = _SlotLayer()
                        layer.adopt(k.new_zeros(len(rows), k.shape[1], width + room, k.shape[3]),
                                    v.new_zeros(len(rows), v.shape[1], width + room, v.shape[3]), width)
                        layers.append(layer)
                for layer, s_layer in zip(layers, src.cache.layers):
                    for buf, full in ((layer._k, s_layer.keys), (layer._v, s_layer.values)):
                        rows_kv = full.index_select(0, idx)
                        gather = order[:, None, :, None].expand(-1, rows_kv.shape[1], -1, rows_kv.shape[3])
                        buf[dst, :, width - cm : width] = rows_kv.gather(2, gather)
            if layers:
                group.cache = Cache(layers=layers)
            groups.append(group)
        self.groups = groups
        self.where = {r: (gi, i) for gi, g in enumerate(groups) for i, r in enumerate(g.rows)}

    @torch.no_grad()
    def feed(self, blocks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append each live row's new tokens (at least one each); the logits [V] after each row's last token."""
        out: dict[int, torch.Tensor] = {}
        for group in self.groups:
            width = max(len(blocks[r]) for r in group.rows if r in self.where)
            ids = torch.full((len(group.rows), width), self.pad_id, dtype=torch.long)
            pos = torch.zeros((len(group.rows), width), dtype=torch.long)
            real = torch.zeros((len(group.rows), width), dtype=torch.long)
            for i, r in enumerate(group.rows):
                if r not in self.where:
                    continue
                b = blocks[r]
                if not b:
                    raise ValueError(f"row {r}: nothing to feed")
                ids[i, width - len(b):] = torch.tensor(b)
                pos[i, width - len(b):] = torch.arange(group.pos[i], group.pos[i] + len(b))
                real[i, width - len(b):] = 1
                group.pos[i] += len(b)
            logits = self._forward(group, ids, pos, real)
            out |= {r: logits[i] for i, r in enumerate(group.rows) if r in self.where}
        return out

    @torch.no_grad()
    def step(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        """Append one token to each row in `tokens` (the others get a masked pad); their next-token
        logits. A group with no row in `tokens` is not run."""
        out: dict[int, torch.Tensor] = {}
        for group in self.groups:
            if not any(r in tokens for r in group.rows):
                continue
            ids = torch.full((len(group.rows), 1), self.pad_id, dtype=torch.long)
            pos = torch.tensor([[p] for p in group.pos], dtype=torch.long)
            real = torch.zeros((len(group.rows), 1), dtype=torch.long)
            for i, r in enumerate(group.rows):
                if r in tokens:
                    ids[i, 0], real[i, 0] = tokens[r], 1
                    group.pos[i] += 1
            logits = self._forward(group, ids, pos, real)
            out |= {r: logits[i] for i, r in enumerate(group.rows) if r in tokens}
        return out

    def _forward(self, group: _Group, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        fresh = group.cache is None
        if fresh:
            group.cache = Cache(layer_class_to_replicate=_SlotLayer)
        group.mask = torch.cat([group.mask, real.to(self.device)], dim=1)
        if fresh and len(ids) > 1:
            # one prefill per distinct first block: a group's G episodes start from the same prompt, so it is
            # computed once and its keys and values copied to the others (exact: the same ids, positions, mask)
            _, inverse = torch.unique(torch.cat([ids, pos, real], dim=1), dim=0, return_inverse=True)
            first = torch.full((int(inverse.max()) + 1,), len(ids), dtype=torch.long)
            first.scatter_reduce_(0, inverse, torch.arange(len(ids)), reduce="amin")
            if len(first) < len(ids):
                rank = torch.empty_like(first)  # unique rows in the order they first appear
                order = first.argsort()
                rank[order] = torch.arange(len(first))
                keep, where = first[order], rank[inverse].to(self.device)
                logits = self._run(ids[keep], group.mask[keep.to(self.device)], pos[keep], group.cache)
                for layer in group.cache.layers:
                    layer.expand(where)
                return logits[where]
        return self._run(ids, group.mask, pos, group.cache)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask, position_ids=pos.to(self.device),
                         use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
        return out.logits[:, -1].float()
