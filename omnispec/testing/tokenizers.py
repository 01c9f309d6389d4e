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


def gemma_tokenizer(max_length: int = 1024):
    """A byte-pair Gemma tokenizer (metaspace pre-tokenizer; ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 as Gemma's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
                                  initial_alphabet=[*_ALPHABET, *string.ascii_uppercase, "\u2581"], show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    out = GemmaTokenizerFast(vocab=model["vocab"], merges=merges)
    out.model_max_length = max_length
    return out


# ---- Qwen-style tokenizers (Qwen-Image, Z-Image, HunyuanVideo-1.5) --------------------------------------

QWEN_SENTENCES = [*SENTENCES, "dance monkey", "bad quality", "make it blue", "a cat holding a sign",
                  "You are a helpful assistant. Describe the image by detailing the color, shape and size"]
QWEN_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                       "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5's chat layout (a default system turn unless one is given; image parts as vision tokens).
QWEN25_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's: no default system turn; enable_thinking=false adds an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen_tokenizer(chat_template: str = QWEN25_CHAT_TEMPLATE):
    """A byte-level BPE Qwen2 tokenizer (``<|endoftext|>`` pads, Qwen's chat and vision special tokens, ids below
    512). The vocabulary is small, so the pipelines' fixed template lengths (34, 64, 108 tokens) fall inside the
    template as with the real tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(QWEN_SENTENCES, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    out = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    out.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS})
    out.chat_template = chat_template
    out.padding_side = "right"
    out.model_max_length = 131072
    return out


def qwen_vl_processor(tokenizer_or_path):
    """A ``Qwen2VLProcessor`` (image processor + tokenizer) from a tokenizer, or loaded from a saved ``processor/``
    folder. Built without a video processor, which transformers builds only with torchvision installed; small
    ``longest_edge`` keeps the vision sequence short."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImageOnlyQwen2VLProcessor(*qwen_vl_parts(tokenizer_or_path))


def qwen_vl_parts(tokenizer_or_path):
    """The image processor and tokenizer of a Qwen-VL processor: loaded from a saved ``processor/`` folder, or a small
    image processor (short vision sequences) beside the given tokenizer."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor

    if isinstance(tokenizer_or_path, (str, bytes)) or hasattr(tokenizer_or_path, "__fspath__"):
        return Qwen2VLImageProcessor.from_pretrained(tokenizer_or_path), Qwen2Tokenizer.from_pretrained(tokenizer_or_path)
    return Qwen2VLImageProcessor(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}), tokenizer_or_path
