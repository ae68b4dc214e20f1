"""A real model on real hardware is a change of params (issue 14), shown on CPU: bf16 autocast over
fp32 master weights, gradient checkpointing and LoRA train a tiny Qwen2-architecture model through the
SFT and RL stage functions; the merged export loads with `from_pretrained` and gives the adapted
model's outputs, not the base's; settings this machine cannot honour stop the run by name."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agentkiln.config import ComputeParams, LoRAParams
from agentkiln.policy import load_policy, lora, save_policy
from agentkiln.stages.common import load_split
from agentkiln.stages.rl import run_rl
from agentkiln.stages.sft import run_sft
from agentkiln.trainers.batch import build_batch, token_logprobs
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes

from tests.conftest import make_chat_model, params_with, task_texts, tiny_dataset

MIX = {"frozenlake_easy": 1.0}
BF16 = {"dtype": "bf16", "gradient_checkpointing": True, "device": "cpu"}
LORA = {"enabled": True, "r": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    tasks_dir = tiny_dataset(root / "tasks", {"sft": MIX, "rl": MIX, "test": MIX}, {"sft": 12, "rl": 4, "test": 4})
    model = make_chat_model(root / "qwen2", "qwen2", task_texts(load_split(tasks_dir, "sft"), tasks_dir))
    return root, tasks_dir, model


def probe_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


def test_bf16_gradient_checkpointing_and_lora_train_a_qwen2_model_through_sft_and_rl(world, tmp_path):
    _, tasks_dir, base_dir = world
    params = params_with({
        "compute": BF16,
        "sft": {"model": {"source": str(base_dir), "max_context": 1024}, "epochs": 4, "batch_size": 4, "lr": 0.01,
                "warmup_steps": 0, "lora": LORA},
        "rl": {"defaults": {"algorithm": "grpo", "iterations": 2, "tasks_per_iter": 2, "group_size": 4, "max_turns": 3,
                            "episode_budget": None, "kl_coef": 0.05,
                            "reward": {"truncation": {"weight": 0.5}},  # holes vs running out of turns: groups vary "lr": 0.005, "minibatch_size": 4,
                            "micro_batch_size": 2, "lora": LORA, "select": {"panel": None}},
               "stages": {"main": {"init": "sft"}}},
    })
    curve = []
    sft = run_sft(params, tasks_dir, tmp_path / "sft", log=lambda row, step: curve.append(row["sft/loss"]))
    assert curve[-1] < curve[0]  # it learns in bf16 with checkpointing, adapters only
    # the merge is checked at save: merged == adapted, and the adapters moved it away from the base
    assert sft["lora_merged_vs_adapted"] < 1e-3 and sft["lora_merged_vs_base"] > 1e-3
    adapter = json.loads((tmp_path / "sft" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and set(adapter["target_modules"]) == set(LORA["target_modules"])
    assert adapter["base_model_name_or_path"] == "qwen2"  # its name: no path of this machine in the outputs
    # only the adapted projections changed; the frozen embeddings are the base's, bit for bit
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    assert merged.dtype == torch.float32  # fp32 master weights are what is saved

    rl = run_rl(params, "main", tasks_dir, tmp_path / "sft", tmp_path / "rl", tmp_path / "reports")
    assert rl["iterations"] == 2 and rl["lora_merged_vs_adapted"] < 1e-3
    rows = (tmp_path / "reports" / "curve.csv").read_text().splitlines()
    header = rows[0].split(",")
    # the KL reference is the same model with its adapters off: a real, finite KL after the first update
    kl = [float(r.split(",")[header.index("kl")]) for r in rows[1:]]
    assert len(kl) == 2 and all(k == k and k >= 0 for k in kl) and kl[-1] > 0  # it moved off the reference
    assert (tmp_path / "rl" / "adapter" / "adapter_model.safetensors").is_file()
    assert type(load_policy(tmp_path / "rl").model).__name__ == "Qwen2ForCausalLM"


def test_the_merged_export_gives_the_adapted_models_outputs_and_not_the_bases(world, tmp_path):
    _, tasks_dir, base_dir = world
    policy = load_policy(base_dir, compute=ComputeParams(device="cpu"))
    lora.add_lora(policy, LoRAParams(**LORA), seed=0)
    ids = policy.tokenizer.encode("go north and take the red key from the table")
    assert torch.equal(probe_logits(policy.model, ids), probe_logits(AutoModelForCausalLM.from_pretrained(base_dir), ids))
    # a few optimizer steps move the adapters (B starts at zero)
    opt = torch.optim.AdamW(policy.trainable(), lr=0.05)
    assert all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
    for _ in range(3):
        out = policy.model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    adapted = probe_logits(policy.model, ids)
    with lora.reference(policy):
        base = probe_logits(policy.model, ids)
    check = lora.merge(policy, tmp_path / "out")
    save_policy(policy, tmp_path / "out")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # a plain HF model, no peft needed
    assert (probe_logits(exported, ids) - adapted).abs().max() < 1e-4
    assert (probe_logits(exported, ids) - base).abs().max() > 1e-2
    assert check["merged_vs_base"] > 1e-2
    # the saved adapter on the untouched base gives the same model
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "out" / "adapter")
    assert (probe_logits(reloaded, ids) - adapted).abs().max() < 1e-4
    assert type(load_policy(tmp_path / "out").model).__name__ == "Qwen2ForCausalLM"


def test_bf16_autocast_runs_the_forward_in_bf16_over_fp32_weights(world):
    _, tasks_dir, base_dir = world
    fp32 = load_policy(base_dir, compute=ComputeParams(device="cpu"))
    bf16 = load_policy(base_dir, compute=ComputeParams(**BF16))
    assert bf16.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert bf16.model.is_activation_checkpointing and not fp32.model.is_activation_checkpointing
    tasks = load_split(tasks_dir, "rl")
    eps = run_episodes(PolicyAgent(fp32, greedy=True), tasks, tasks_dir, max_turns=2)
    batch = build_batch(eps, fp32.pad_id)
    lp32, _ = token_logprobs(fp32.model, batch, with_entropy=False)
    seen = []
    hook = bf16.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with bf16.autocast():
        lp16, _ = token_logprobs(bf16.model, batch, with_entropy=False)
    hook.remove()
    assert seen == [torch.bfloat16]  # the matmuls ran in bf16 (norms and log-softmax stay fp32)
    diff = (lp32 - lp16).abs().max()
    assert 0 < diff < 0.1  # bf16 rounding, really applied, and small


def test_settings_this_machine_cannot_honour_stop_the_run_by_name(world):
    _, _, base_dir = world
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="compute.device = cuda: torch sees no CUDA device"):
            load_policy(base_dir, compute=ComputeParams(device="cuda"))
    with pytest.raises(ValueError, match="flash_attention_2 needs a CUDA device"):
        load_policy(base_dir, compute=ComputeParams(device="cpu", attn_implementation="flash_attention_2"))
    policy = load_policy(base_dir)
    with pytest.raises(ValueError, match=r"lora.target_modules: \['qkv'\] name no linear layer"):
        lora.add_lora(policy, LoRAParams(enabled=True, target_modules=["qkv"]), seed=0)
    with pytest.raises(ValueError, match="device 'gpu'"):
        ComputeParams(device="gpu")


def test_peft_is_imported_only_when_lora_is_used():
    """peft's import is ~2 s of every model stage's start: without LoRA no stage module imports it (the
    LoRA tests above import it through add_lora)."""
    import subprocess
    import sys

    code = ("import sys\nimport flows.base, flows.sft, flows.rl, flows.distill, flows.evaluate\n"
            "from agentkiln.policy import lora\nassert 'peft' not in sys.modules, 'peft imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
