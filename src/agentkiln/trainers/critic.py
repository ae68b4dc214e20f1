"""PPO's value model: a copy of the starting policy's decoder with a scalar head.

V of a turn is read at the last token before its reply (the end of the generation prompt: the state
the reply is chosen in), from one forward over each episode window. The critic is separate from the
policy (as in verl): its regression loss never moves the policy's weights. Its head starts at zero,
so the first advantages are plain discounted returns.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from agentkiln.trainers.batch import Batch, hidden_at


def decision_positions(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn indices present in `batch`, [M, 2] row/column of the token before each one's reply)."""
    pos = batch.loss_mask.nonzero()
    turn = batch.flat(batch.turn_index)
    first = torch.ones(len(turn), dtype=torch.bool)
    first[1:] = turn[1:] != turn[:-1]
    at = pos[first].clone()
    at[:, 1] -= 1
    return turn[first], at


class Critic(nn.Module):
    def __init__(self, policy_model: nn.Module):
        super().__init__()
        # a separate network (verl's critic): the value loss must not move the policy. With LoRA the
        # copy (adapters included) trains in full: values need more than a low-rank change.
        self.body = copy.deepcopy(policy_model).requires_grad_(True)
        self.head = nn.Linear(policy_model.config.hidden_size, 1, device=next(policy_model.parameters()).device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(turn indices, V of each) for the turns whose replies start in `batch`'s rows."""
        turns, at = decision_positions(batch)
        h = hidden_at(self.body, batch.input_ids, batch.attention_mask, at)
        return turns.to(h.device), self.head(h.float()).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: Batch, rows_per_pass: int = 16) -> torch.Tensor:
        """V of every turn index of the batch, [M]."""
        self.eval()
        out = torch.zeros(len(batch.turns))
        for i in range(0, batch.rows, rows_per_pass):
            turns, v = self(batch.select(list(range(i, min(i + rows_per_pass, batch.rows)))))
            out[turns.cpu()] = v.float().cpu()
        return out


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), mean."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()
