"""From played episodes to the batch's advantage column, by the estimator `rl.algorithm` names.

    turn rewards (shaped) --estimator--> advantage per turn or per token --> batch.advantages [R, T]

Turn rewards: the stage's reward components (agentkiln.rewards: the verifier's outcome, penalties,
shaping, a learned process reward, a judge; `p.reward`); with `kl_in_reward`, every reply token also
gets -kl_coef * its KL estimate to the reference (a turn's reward then includes its tokens' penalties).

The estimators are registered by name (agentkiln.algos.registry; the built-ins and their formulas:
agentkiln.algos.estimators); this module lays the batch's turns and tokens out for them (one
`Credit`) and writes the result back. With `adv_norm` (family / task_type), each family's (type's)
token advantages are then divided by their root mean square (algos.advantages.scale_normalise):
multi-task balance. With `positive_weight` < 1, positive token advantages are then scaled by it
(W-REINFORCE, algos.advantages.weight_positive).
"""

from __future__ import annotations

import torch

from agentkiln import rewards as R
from agentkiln.algos import advantages as A
from agentkiln.algos import registry
from agentkiln.algos.estimators import Credit
from agentkiln.config import RLParams
from agentkiln.rewards import RewardState
from agentkiln.rollout.episode import Episode
from agentkiln.trainers.batch import Batch


def shaped_turn_rewards(episodes: list[Episode], p: RLParams, rewards: RewardState | None = None
                        ) -> list[list[float]]:
    """Each turn's reward: the stage's reward components (`rewards`: the trainer's reward state; None:
    a fresh one, enough for every component but a trained process model or a judge)."""
    return R.turn_rewards(episodes, p.reward, rewards or RewardState(p))[0]


def turn_rewards(batch: Batch, episodes: list[Episode], p: RLParams, token_kl: torch.Tensor | None = None,
                 rewards: RewardState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per turn index of the batch: episode, shaped reward (KL penalties of its tokens folded in)."""
    shaped = shaped_turn_rewards(episodes, p, rewards)
    ep_of = torch.tensor([e for e, _ in batch.turns], dtype=torch.long)
    reward = torch.tensor([shaped[e][k] for e, k in batch.turns])
    if token_kl is not None:
        reward = reward.index_add(0, batch.flat(batch.turn_index), -p.kl_coef * token_kl)
    return ep_of, reward


def advantages(batch: Batch, episodes: list[Episode], p: RLParams, token_kl: torch.Tensor | None = None,
               values: torch.Tensor | None = None, rewards: RewardState | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantage of every reply token [R, T], critic targets per turn index [M] or None).
    `token_kl`: flat [N] KL estimates (kl_in_reward); `values`: critic value per turn index [M] (an
    estimator that needs a critic); `rewards`: the trainer's reward state (shaped_turn_rewards).
    Every turn of every episode must be in the batch (turn indices cover episodes in order)."""
    ep_of, turn_r_shaped = turn_rewards(batch, episodes, p, rewards=rewards or RewardState(p))
    tok_turn = batch.flat(batch.turn_index)
    kl = None if token_kl is None else p.kl_coef * token_kl
    turn_r = turn_r_shaped if kl is None else turn_r_shaped.index_add(0, tok_turn, -kl)
    credit = Credit(episode_reward=torch.zeros(len(episodes)).index_add(0, ep_of, turn_r),
                    group=torch.tensor([ep.group for ep in episodes]), turn_reward=turn_r,
                    turn_reward_shaped=turn_r_shaped, turn_episode=ep_of,
                    turn_step=torch.tensor([k for _, k in batch.turns], dtype=torch.long),
                    turn_anchor=[episodes[e].turns[k].anchor for e, k in batch.turns], token_turn=tok_turn,
                    token_kl=kl, values=values)
    tok_adv, returns = registry.estimator(p.algorithm).fn(credit, p)
    if p.adv_norm != "none":
        key = [getattr(ep, p.adv_norm) or ep.family for ep in episodes]
        tok_adv = A.scale_normalise(tok_adv.float(), [key[int(e)] for e in ep_of[tok_turn]])
    if p.positive_weight != 1.0:
        tok_adv = A.weight_positive(tok_adv, p.positive_weight)
    out = torch.zeros(batch.loss_mask.shape)
    out[batch.loss_mask] = tok_adv.float()
    return out, returns
