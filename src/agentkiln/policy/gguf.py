"""A GGUF file (llama.cpp's single-file format) as an ordinary Hugging Face model directory.

transformers reads GGUF and dequantizes its weights to fp32 (`from_pretrained(dir, gguf_file=NAME)`);
the model it returns refuses `save_pretrained` ("quantized with gguf ... not serializable"), so its
weights are moved into a model built from the same config without the quantization config, which
saves as safetensors, beside the tokenizer and its chat template. Every way a file can be unusable
is refused by name before anything is written: not GGUF, truncated, an architecture transformers
cannot load, weights that do not fit the config, a tokenizer without a chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch

from agentkiln.errors import UserError

MAGIC = b"GGUF"


class GGUFError(UserError, ValueError):
    """A GGUF file that cannot become a model directory: the message names the file and why."""


def read_header(path: str | Path) -> dict:
    """The file's architecture, name and tensor count, after checking it is a whole GGUF file (the
    reader maps every tensor: a truncated file fails here, not halfway through a conversion)."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r}); give a .gguf model file, "
                        "a Hugging Face model directory or a packaged model name")
    import gguf  # noqa: PLC0415  (only a GGUF source needs it)

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, IndexError, struct errors alike)
        raise GGUFError(f"{path}: a damaged or truncated GGUF file ({type(e).__name__}: {e}); fetch it again "
                        "and check its sha256") from None

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else None

    return {"architecture": text("general.architecture"), "name": text("general.name"),
            "tensors": len(reader.tensors)}


def load_gguf(path: str | Path) -> tuple[torch.nn.Module, object]:
    """(an fp32 causal LM that saves normally, its tokenizer) from a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    path = Path(path)
    header = read_header(path)
    where, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32,
                                                      local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise GGUFError(f"{path}: transformers cannot load this GGUF model (architecture "
                        f"{header['architecture']!r}: {str(e).splitlines()[0][:300]}); use a model of an architecture "
                        "it reads from GGUF (llama, qwen2, gemma3, ...) or a Hugging Face directory") from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {k for k in missing if "lm_head" in k} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise GGUFError(f"{path}: its weights do not fit its own config (missing {sorted(set(missing) - tied)[:4]}, "
                        f"unexpected {sorted(unexpected)[:4]})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if getattr(tokenizer, "chat_template", None) is None:
        raise GGUFError(f"{path}: its tokenizer has no chat template (tokenizer.chat_template is not in the file); "
                        "agentkiln renders episodes as conversations: use an instruct / chat model")
    return model.eval(), tokenizer
