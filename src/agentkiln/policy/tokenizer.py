"""The scratch policy's tokenizer: a byte-level BPE trained on the synthesized task text (no hub,
no download), with a small chat template of its own; and the round-trip check every tokenizer
passes at load.

Byte-level BPE is lossless (decode(encode(x)) == x), so model-written SQL, Python and search
queries reach the tools exactly as generated; trained on the closed vocabulary of the tasks, most
words are one token. Digits are single tokens (as in Llama 3 and Qwen): a number then has the same
ids wherever it appears, so copying a tool's result into an answer is a copy, not a lookup (a
whole-number token " 335666" after a space and "335666" after a bracket would be two unrelated ids).
Real chat models bring their own tokenizer and template (agentkiln.policy.chat).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentkiln.errors import UserError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = [f"<|{r}|>" for r in ROLES]
# <|role|> opens a message; an assistant message ends with EOS (the end-of-turn token generation stops at)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_scratch_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                  additional_special_tokens=ROLE_TOKENS)
    out.chat_template = CHAT_TEMPLATE
    return out


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot encode the task text: training on it would be silent garbage."""


def check_tokenizer(tokenizer, texts: list[str], source: str) -> None:
    """Stop a run whose tokenizer does not encode the task text: no ids, only unknown tokens, or a
    decode that loses the text. (transformers 5.17-5.23 load a word-level tokenizer.json under a
    qwen2 config as a Qwen2Tokenizer whose encode returns []: every action would become EOS.)"""
    unk = tokenizer.unk_token_id
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        why = ""
        if not ids:
            why = "encodes it to no token ids"
        elif unk is not None and all(i == unk for i in ids):
            why = "encodes it to unknown tokens only"
        elif " ".join(tokenizer.decode(ids, skip_special_tokens=True).split()) != " ".join(text.split()) and (
                unk is None or unk not in ids):
            why = "does not decode it back (lossy round trip)"
        if why:
            raise TokenizerError(
                f"{source}: the tokenizer ({type(tokenizer).__name__}) {why}: {text[:60]!r}. Check that the "
                "directory's tokenizer files match its config (a word-level tokenizer.json under a qwen2 config "
                "loads as a broken Qwen2Tokenizer), or retrain the policy (dvc repro sft).")
    if getattr(tokenizer, "chat_template", None) is None:
        raise TokenizerError(f"{source}: the tokenizer has no chat template; agentkiln renders episodes as "
                             "conversations (set tokenizer.chat_template, or use an instruct/chat model)")
