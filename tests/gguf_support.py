"""Tiny GGUF files written here with the `gguf` package (llama.cpp's own writer): a Llama of a few
thousand random weights with a byte-level BPE tokenizer and a ChatML chat template, and the ways a file
can be wrong. The base stage's tests convert them as it converts the packaged SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary is spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path: Path, architecture: str = "llama", chat_template: str | None = CHATML, hidden: int = 32,
                    layers: int = 2, seed: int = 0) -> Path:
    import gguf

    alphabet = byte_alphabet()
    merges = ["Ġ t", "Ġ a", "h e", "Ġt he"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test-llama")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32) if len(shape) > 1
                     else np.ones(shape, dtype=np.float32))

    t("token_embd.weight", len(tokens), hidden)
    t("output_norm.weight", hidden)
    head = hidden // heads
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden)
        t(f"blk.{i}.attn_q.weight", hidden, hidden)
        t(f"blk.{i}.attn_k.weight", kv_heads * head, hidden)
        t(f"blk.{i}.attn_v.weight", kv_heads * head, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, hidden)
        t(f"blk.{i}.ffn_norm.weight", hidden)
        t(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        t(f"blk.{i}.ffn_up.weight", ffn, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
