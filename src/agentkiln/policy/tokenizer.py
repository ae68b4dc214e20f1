"""A word-level tokenizer built from the synthesized task text (no hub, no download).

TextWorld's language is a small closed vocabulary, so words are the right unit for a tiny
from-scratch policy: actions are 2-5 tokens and prompts stay short.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tokenizers.trainers import WordLevelTrainer
from transformers import PreTrainedTokenizerFast

from agentkiln.policy.prompt import MARKERS

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"


def build_word_tokenizer(texts: Iterable[str], min_frequency: int = 1) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = WordLevelTrainer(special_tokens=[PAD, UNK, BOS, EOS, *MARKERS], min_frequency=min_frequency)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=MARKERS,
    )
