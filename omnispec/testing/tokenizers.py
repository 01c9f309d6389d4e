"""Tokenizers trained here, with the ``tokenizers`` library, on a few sentences (no downloads)."""

from __future__ import annotations

import json
import string

SENTENCES = [
    "a photo of a cat", "a painting of a dog on the beach", "an astronaut riding a horse on the moon",
    "a red car in the snow", "a bowl of fruit on a wooden table", "blurry, low quality, watermark",
    "the digit seven", "zero one two three four five six seven eight nine", "0 1 2 3 4 5 6 7 8 9",
]
_ALPHABET = string.ascii_lowercase + string.digits + string.punctuation


def clip_tokenizer(max_length: int = 77):
    """A byte-pair CLIP tokenizer (``</w>`` word ends, CLIP's special tokens)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
        initial_alphabet=list(_ALPHABET), show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for ch in _ALPHABET:  # every character can also end a word
        vocab.setdefault(ch + "</w>", len(vocab))
    out = CLIPTokenizer(vocab=vocab, merges=[tuple(m) for m in model["merges"]])
    out.model_max_length = max_length
    return out


def t5_tokenizer():
    """A unigram (sentencepiece-style) T5 tokenizer with ``<pad>``, ``</s>``, ``<unk>`` and no extra ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        initial_alphabet=list(string.ascii_letters + string.digits), show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)
