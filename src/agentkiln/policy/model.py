"""Build, load and save the policy: a causal LM, its tokenizer (with a chat template) and the agent
format it was trained with.

`source: scratch` builds a small Llama-style model with random weights and a BPE tokenizer trained
on the task text (the embedded CPU default). Any other source is a local Hugging Face directory
(Qwen2, Llama, ...: `from_pretrained`, never downloading); after loading, every
policy goes through the same code. A tokenizer that cannot encode the task text or has no chat
template stops the run at load, naming the directory.

A saved policy directory carries a manifest (agentkiln_manifest.json: the sha256 of every file, the
directory's format version and the agent format it was trained with), written last by `save_policy`
and checked by `load_policy` before anything is loaded: a missing agent.json, garbage in any file or
weights overwritten (even with finite numbers) stop the run naming the file and the stage to rerun.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agentkiln.artifacts import (ArtifactError, MissingArtifactError, read_json, rebuild_hint, verify_manifest,
                                 write_json, write_manifest)
from agentkiln.config import ComputeParams, ModelParams
from agentkiln.policy import device as dev
from agentkiln.policy.chat import ChatFormat
from agentkiln.policy.prompt import FORMAT_VERSION, AgentFormat
from agentkiln.policy.tokenizer import build_scratch_tokenizer, check_tokenizer

AGENT_FILE = "agent.json"
MANIFEST_FILE = "agentkiln_manifest.json"
POLICY_KIND = "agentkiln-policy"
POLICY_FORMAT = 1  # layout of a saved policy: HF weights + tokenizer + agent.json + manifest
MARKER = "agentkiln_policy_format"  # in config.json: an agentkiln policy (so it must have its manifest)
# what every policy's tokenizer must encode and decode back (plus the task text a stage passes)
PROBE_TEXTS = ["go north", "take the red key from the table", "search[polo shirt]",
               "sql[SELECT name FROM employees WHERE salary > 52000]", "python[print((50 + 25) * 7 / 3)]"]


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer with a chat template
    fmt: AgentFormat = field(default_factory=AgentFormat)
    context: int = 1024  # the agent's context window (tokens of one episode window)
    source: str = "policy"
    dtype: torch.dtype = torch.float32  # compute precision of forward passes (weights stay fp32: `place`)

    @cached_property
    def chat(self) -> ChatFormat:
        return ChatFormat(self.tokenizer, self.fmt.system_prompt, self.fmt.observation_role, self.source)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.chat.end_id if pad is None else pad

    @property
    def max_context(self) -> int:
        return min(self.context, int(getattr(self.model.config, "max_position_embeddings", self.context)))

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        """The context every forward pass of this policy runs in (bf16 autocast, or nothing for fp32)."""
        return dev.autocast(self.device, self.dtype)

    def trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates (with LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]


def place(policy: Policy, compute: ComputeParams | None) -> Policy:
    """Put `policy` where `compute` says: device, attention kernel, gradient checkpointing, and the
    precision its forward passes run in (bf16: autocast over fp32 master weights). None: as loaded."""
    if compute is None:
        return policy
    device = dev.resolve_device(compute.device)
    dev.check_attn(compute.attn_implementation, device)
    model = policy.model
    if getattr(model.config, "_attn_implementation", None) != compute.attn_implementation:
        model.set_attn_implementation(compute.attn_implementation)
    if compute.gradient_checkpointing:
        # non-reentrant: works with frozen inputs (LoRA) and with our partial-logits forward
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.model = model.to(device)
    policy.dtype = dev.resolve_dtype(compute.dtype, device)
    return policy


def build_scratch_model(params: ModelParams, tokenizer, seed: int) -> LlamaForCausalLM:
    """A Llama-style decoder with random weights, sized by `params`, for `tokenizer`'s vocabulary."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=params.hidden_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_heads,
        intermediate_size=params.intermediate_size,
        max_position_embeddings=params.max_context,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_scratch_policy(params: ModelParams, texts: Iterable[str], fmt: AgentFormat, seed: int,
                         compute: ComputeParams | None = None) -> Policy:
    """The embedded default: a BPE tokenizer trained on `texts` + a random-init model (weights drawn
    on the CPU, so the same seed gives the same model on every device)."""
    tokenizer = build_scratch_tokenizer(texts, params.vocab_size)
    policy = Policy(build_scratch_model(params, tokenizer, seed), tokenizer, fmt, params.max_context, "scratch")
    return place(policy, compute)


class _AgentFormatFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    system_prompt: str | None
    show_admissible: bool
    observation_role: Literal["user", "tool"]
    native_tools: bool
    version: str
    system_prompts: dict[str, str] = {}  # absent in agent.json files written before per-family prompts


class AgentFile(BaseModel):
    """agent.json: how the policy was trained to talk (AgentFormat) and its context window."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: _AgentFormatFile
    context: int = Field(ge=1)


def saved_meta(path: Path) -> dict | None:
    """The checked agent.json of a saved policy directory ({"format", "context"}), after its manifest's
    checks (every file present with its recorded sha256); None for a directory agentkiln did not save
    (a Hugging Face model: no manifest, no agent.json, no agentkiln mark in config.json)."""
    path = Path(path)
    hint = rebuild_hint(path)
    if not (path / MANIFEST_FILE).is_file():
        config = read_json(path / "config.json", what="model config", hint=hint) if (path / "config.json").is_file() else {}
        found = [f for f in (AGENT_FILE,) if (path / f).exists()] + (["the agentkiln mark in config.json"]
                                                                      if isinstance(config, dict) and MARKER in config else [])
        if not found:
            return None
        raise MissingArtifactError(
            f"{path / MANIFEST_FILE}: missing: {path} is a saved agentkiln policy ({' and '.join(found)}) without "
            f"its manifest, so its files cannot be checked (damaged, or saved by an older agentkiln); {hint}")
    manifest = verify_manifest(path, MANIFEST_FILE, POLICY_KIND, POLICY_FORMAT, required=(AGENT_FILE, "config.json"),
                               hint=hint)
    agent = read_json(path / AGENT_FILE, AgentFile, "agent format file", hint).model_dump()
    if agent["format"]["version"] != FORMAT_VERSION:
        raise ArtifactError(f"{path / AGENT_FILE}: agent format {agent['format']['version']!r}: this agentkiln reads "
                            f"{FORMAT_VERSION!r} (episodes as conversations); {hint}")
    recorded = manifest.meta.get("agent")
    try:  # the same normal form (fields added since the manifest was written take their defaults)
        recorded = AgentFile.model_validate(recorded).model_dump()
    except ValueError:
        pass
    if recorded != agent:
        raise ArtifactError(f"{path / AGENT_FILE}: disagrees with the training format in {path / MANIFEST_FILE}; {hint}")
    return agent


def load_policy(source: str | Path, fmt: AgentFormat | None = None, context: int | None = None,
                probe: Iterable[str] = (), compute: ComputeParams | None = None) -> Policy:
    """A saved policy directory (checked against its manifest; its agent.json gives format and
    context), or any causal LM directory (then `fmt` / `context` or the defaults). Checks the
    tokenizer on PROBE_TEXTS + `probe`; `compute` places it (device, precision, attention)."""
    source = str(source)
    path = Path(source)
    if not path.is_dir() and (path.is_absolute() or source.startswith((".", "models/", "data/"))):
        raise FileNotFoundError(f"{source}: no such model directory (run the stage that writes it, or fix the path)")
    meta = saved_meta(path) if path.is_dir() else None  # before any file is parsed: damage is named, not crashed on
    if compute is not None:  # a setting this machine cannot honour stops the run before the weights load
        dev.check_attn(compute.attn_implementation, dev.resolve_device(compute.device))
    try:
        # local_files_only: nothing is ever downloaded, and written explicitly it does not end up in a
        # saved tokenizer_config.json as whatever HF_HUB_OFFLINE happened to say (same params, same bytes)
        # fp32 master weights whatever the checkpoint's dtype: bf16 is autocast (`place`)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=True,
                                                     attn_implementation=compute.attn_implementation if compute else None)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except OSError as e:
        where = "a model directory" if path.is_dir() else "a local directory, and loading it as a hub id failed"
        raise FileNotFoundError(f"{source}: not {where} with config.json, weights and tokenizer files ({e})") from e
    meta = meta or {}
    if fmt is None:
        fmt = AgentFormat.from_dict(meta["format"]) if meta else AgentFormat()
    context = context or meta.get("context") or int(getattr(model.config, "max_position_embeddings", 2048))
    check_tokenizer(tokenizer, [*PROBE_TEXTS, *probe], source)
    policy = Policy(model.eval(), tokenizer, fmt, context, source)
    policy.chat  # noqa: B018  (a template that cannot be split fails here, at load)
    return place(policy, compute)


def save_policy(policy: Policy, out_dir: str | Path, source: dict | None = None) -> Path:
    """Weights, tokenizer, agent.json, then the manifest of them all (written last: a directory whose
    save was interrupted has none, and is refused at load). `source`: where the weights came from (the
    base stage: kind, name, digests), kept in the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    setattr(policy.model.config, MARKER, POLICY_FORMAT)
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    meta = {"format": policy.fmt.to_dict(), "context": policy.context}
    write_json(out / AGENT_FILE, meta)
    write_manifest(out, MANIFEST_FILE, POLICY_KIND, POLICY_FORMAT,
                   meta={"agent": meta} | ({"source": source} if source else {}))
    return out
