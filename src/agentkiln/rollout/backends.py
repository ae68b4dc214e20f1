"""Rollout backends: who generates the replies of an RL iteration (params: `compute.rollout`).

    hf    agentkiln's KV-cache engine (rollout.agents.PolicyAgent) in the trainer's process: it reads
          the live weights, so there is nothing to sync and its log-probs are the trainer's own.
          Asynchronous RL plays it on a snapshot of the weights instead (SnapshotRollout), refreshed in
          memory by `sync`, so it can play while the trainer updates the live model.
    vllm  a vLLM engine in its own environment and process (rollout.vllm_backend): weights are pushed
          to it every iteration (`sync`), and the trainer recomputes the log-probs of what it generated
          (`recompute`): the rollout/trainer mismatch is logged and can be corrected (rl.tis_cap).

Both hand out agents with one contract (`begin(episodes)`, `act(episodes, envs)`), so
rollout.engine.run_episodes plays them the same way and episodes carry the exact generated ids.
"""

from __future__ import annotations

import copy

import torch

from agentkiln.config import ComputeParams
from agentkiln.policy import lora
from agentkiln.policy.model import Policy
from agentkiln.rollout.agents import PolicyAgent


class HFRollout:
    recompute = False  # the behaviour log-probs are the trainer's (same weights, same kernels)

    def __init__(self, policy: Policy):
        self.policy = policy

    def agent(self, temperature: float, greedy: bool, seed: int, batch_size: int, decoding: dict[str, str],
              max_reply_tokens: int | None) -> PolicyAgent:
        return PolicyAgent(self.policy, temperature=temperature, greedy=greedy, seed=seed, batch_size=batch_size,
                           decoding=decoding, max_reply_tokens=max_reply_tokens)

    def sync(self, policy: Policy) -> None:
        self.policy = policy

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SnapshotRollout(HFRollout):
    """The in-process engine on its own copy of the weights (asynchronous RL): `sync` copies the
    trainer's weights into it (in memory), and nothing else changes them, so a worker thread can play
    on it while the trainer updates the live model. Its log-probs are the behaviour policy's; the
    trainer recomputes them under its own weights (`recompute`)."""
    recompute = True

    def __init__(self, policy: Policy):
        super().__init__(copy.deepcopy(policy))
        self.policy.model.eval().requires_grad_(False)

    def sync(self, policy: Policy) -> None:
        self.load(policy.model.state_dict())

    def load(self, weights: dict) -> None:
        """Copy `weights` (all of the model's, or some: under LoRA the adapters alone) into the snapshot."""
        mine = self.policy.model.state_dict()  # views of the snapshot's tensors
        with torch.no_grad():
            for k, v in weights.items():
                mine[k].copy_(v)


def snapshot_weights(policy: Policy) -> dict:
    """`policy`'s weights copied to the CPU, for a SnapshotRollout to `load`; under LoRA the adapters
    alone (the frozen base is in every copy already: weight sync moves adapters only)."""
    trained = {n for n, w in policy.model.named_parameters() if w.requires_grad} if lora.has_lora(policy) else None
    return {k: v.detach().to("cpu", copy=True) for k, v in policy.model.state_dict().items()
            if trained is None or k in trained}


def open_rollout(policy: Policy, compute: ComputeParams | None, seed: int = 0, lora: bool = False):
    """The backend `compute.rollout.backend` names, started from `policy`'s current weights."""
    if compute is None or compute.rollout.backend == "hf":
        return HFRollout(policy)
    from agentkiln.rollout.vllm_backend import VLLMRollout  # noqa: PLC0415  (the vLLM client: only when asked for)
    return VLLMRollout(policy, compute.rollout.vllm, policy.device, seed=seed, lora=lora)
