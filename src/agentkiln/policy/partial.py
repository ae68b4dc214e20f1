"""Partial fine-tuning: only the last k decoder layers (and the final norm) train.

The embeddings and the layers below are frozen, so the backward pass stops at layer L - k: with 15 of
SmolLM2's 30 layers a CPU trains about twice as fast as the whole model (bench/real_model.py), and
with 8 about three times. Nothing else changes: the forward pass, the saved model, LoRA (adapters
below the cut are frozen too). Tied embeddings (the LM head is the embedding matrix) stay frozen.
"""

from __future__ import annotations

import contextlib

import torch

from agentkiln.policy.model import Policy


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (Llama, Qwen2, Gemma, ...: `get_decoder().layers`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA (peft)
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"top_layers: {type(base).__name__} has no decoder layer stack (get_decoder().layers); "
                         "set top_layers: null to train the whole model")
    return layers


@contextlib.contextmanager
def top_layers(policy: Policy, k: int | None):
    """Inside: everything but the last `k` decoder layers and the final norm is frozen (None: nothing
    changes); on exit what this froze trains again, so the next stage starts as it was given."""
    if k is None:
        yield policy
        return
    layers = decoder_layers(policy.model)
    if k > len(layers):
        raise ValueError(f"top_layers = {k}: {policy.source} has {len(layers)} decoder layers; use at most that, "
                         "or null for the whole model")
    keep = {id(p) for layer in layers[len(layers) - k:] for p in layer.parameters()}
    base = policy.model.get_base_model() if hasattr(policy.model, "get_base_model") else policy.model
    norm = getattr(base.get_decoder(), "norm", None)
    if norm is not None:
        keep |= {id(p) for p in norm.parameters()}
    frozen = [p for p in policy.model.parameters() if p.requires_grad and id(p) not in keep]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield policy
    finally:
        for p in frozen:
            p.requires_grad_(True)
