"""LoRA adapters (peft) on a policy: training, the frozen reference, and what a stage saves.

With LoRA only the adapters train. The KL reference is the same model with its adapters disabled
(no second copy of the weights). A stage saves two things: the adapter alone (`adapter/` in the
stage's model directory: a few MB, what people share) and the merged model (the rest of the
directory: a plain Hugging Face model that `from_pretrained` loads and the next stage starts from).
The merge is checked: the merged model must give the adapted model's logits, and an adapter that
training moved must make it differ from the base (verl#4553: "merged" models byte-identical to the
base). B starts at zero, so an untrained adapter is a no-op, and is reported as one.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from agentkiln.config import LoRAParams
from agentkiln.policy.model import PROBE_TEXTS, Policy

ADAPTER_DIR = "adapter"


def add_lora(policy: Policy, p: LoRAParams, seed: int) -> Policy:
    """Wrap the policy's model with fresh adapters on every module whose name ends with one of
    `p.target_modules` (A drawn from `seed`, B zero: the adapted model starts equal to the base)."""
    names = {n.rsplit(".", 1)[-1] for n, m in policy.model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in p.target_modules if t not in names]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} name no linear layer of {policy.source} "
                         f"(its linear layers: {sorted(names)})")
    from peft import LoraConfig, get_peft_model  # imported when used: ~2 s of every stage's start otherwise

    cfg = LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=list(p.target_modules),
                     task_type="CAUSAL_LM")
    device = policy.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy.model = get_peft_model(policy.model, cfg).to(device)
    return policy


def has_lora(policy: Policy) -> bool:
    peft = sys.modules.get("peft")  # never imported: no model can be a PeftModel
    return peft is not None and isinstance(policy.model, peft.PeftModel)


def reference(policy: Policy) -> contextlib.AbstractContextManager:
    """Inside this context the policy's model is the frozen base (adapters off): the KL reference."""
    return policy.model.disable_adapter() if has_lora(policy) else contextlib.nullcontext()


@torch.no_grad()
def _probe_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def merge(policy: Policy, out_dir: str | Path) -> dict:
    """Save the adapter to `out_dir`/adapter, then merge it into the weights in place (the policy is a
    plain model afterwards, ready for save_policy). Returns the merge check: max |logit difference| of
    merged vs adapted (must be ~0) and of merged vs base (0 only if training never moved the adapter)."""
    model = policy.model
    adapter = Path(out_dir) / ADAPTER_DIR
    # the base's directory name, not its path: no path of this machine in the outputs (same bytes in every clone)
    model.peft_config["default"].base_model_name_or_path = Path(policy.source).name
    model.save_pretrained(adapter, save_embedding_layers=False)  # adapters only (embeddings are frozen)
    ids = torch.tensor([policy.tokenizer.encode(" ".join(PROBE_TEXTS))], device=policy.device)
    model.eval()
    adapted = _probe_logits(model, ids)
    with model.disable_adapter():
        base = _probe_logits(model, ids)
    policy.model = model.merge_and_unload()
    merged = _probe_logits(policy.model, ids)
    check = {"merged_vs_adapted": float((merged - adapted).abs().max()),
             "merged_vs_base": float((merged - base).abs().max())}
    tol = 1e-3 * max(1.0, float(adapted.abs().max()))
    if check["merged_vs_adapted"] > tol:
        raise RuntimeError(f"LoRA merge of {policy.source}: the merged model's logits differ from the adapted "
                           f"model's by {check['merged_vs_adapted']:.3g} (> {tol:.3g}); not saving a wrong model")
    return check
