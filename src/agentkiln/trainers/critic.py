"""PPO's value model: a copy of the starting policy's transformer with a scalar head.

V(s) is read at the last prompt token of a turn (the state the action is chosen in). The critic is
separate from the policy (as in verl): its regression loss never moves the policy's weights. Its
head starts at zero, so the first advantages are plain discounted returns.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from agentkiln.rollout.constrained import left_pad


class Critic(nn.Module):
    def __init__(self, policy_model: nn.Module):
        super().__init__()
        self.body = copy.deepcopy(policy_model.base_model)
        self.head = nn.Linear(policy_model.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, prompts: list[list[int]], pad_id: int) -> torch.Tensor:
        """V of each prompt, [B]. Left padding puts every prompt's last token at the end."""
        ids, mask = left_pad(prompts, pad_id)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=position).last_hidden_state
        return self.head(hidden[:, -1].float()).squeeze(-1)

    @torch.no_grad()
    def values(self, prompts: list[list[int]], pad_id: int, batch_size: int = 64) -> list[float]:
        self.eval()
        out: list[float] = []
        for i in range(0, len(prompts), batch_size):
            out += self(prompts[i : i + batch_size], pad_id).tolist()
        return out


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), mean."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()
