"""Build, load and save the policy: a Llama-style causal LM + tokenizer + prompt format.

`source: scratch` builds a small model with random weights (the embedded CPU default); any other
source is a local directory or hub id loaded with `from_pretrained` (the same code path after that).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agentkiln.config import ModelParams
from agentkiln.policy.prompt import AgentFormat
from agentkiln.policy.tokenizer import build_word_tokenizer

AGENT_FILE = "agent.json"
MAX_ACTION_TOKENS = 16  # room kept at the end of the context for the reply


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    fmt: AgentFormat

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    @property
    def max_context(self) -> int:
        return min(int(getattr(self.model.config, "max_position_embeddings", 2048)), 4096)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids, left-truncated so that prompt + reply fit the context."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        budget = self.max_context - MAX_ACTION_TOKENS - (bos is not None)
        ids = ids[-budget:]
        return ([bos] if bos is not None else []) + ids

    def encode_action(self, action: str) -> list[int]:
        """The reply the policy must produce for `action`: its tokens then end-of-sequence.

        The prompt ends with a marker and the reply follows after a space: BPE tokenizers (real
        models) encode a word differently after a space; the word-level one ignores it."""
        ids = self.tokenizer.encode(" " + action, add_special_tokens=False)
        return ids[: MAX_ACTION_TOKENS - 1] + [self.eos_id]


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


def build_scratch_policy(params: ModelParams, texts: Iterable[str], fmt: AgentFormat, seed: int) -> Policy:
    """The embedded default: word-level tokenizer from `texts` + a random-init model."""
    tokenizer = build_word_tokenizer(texts)
    return Policy(model=build_scratch_model(params, tokenizer, seed), tokenizer=tokenizer, fmt=fmt)


def load_policy(source: str | Path, fmt: AgentFormat | None = None) -> Policy:
    """Load a saved policy directory, or any local/hub causal LM (then `fmt` or the default)."""
    source = str(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    agent_file = Path(source) / AGENT_FILE
    if fmt is None:
        fmt = AgentFormat(**json.loads(agent_file.read_text())) if agent_file.is_file() else AgentFormat()
    return Policy(model=model, tokenizer=tokenizer, fmt=fmt)


def save_policy(policy: Policy, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    (out / AGENT_FILE).write_text(json.dumps(policy.fmt.to_dict(), indent=2, sort_keys=True) + "\n")
    return out
