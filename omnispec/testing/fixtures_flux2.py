"""Tiny FLUX.2 [dev] checkpoint (``Flux2Pipeline``): a Mistral3 vision-language text encoder deep enough for the
pipeline's hidden-state layers (10, 20, 30), a tokenizer trained here, FLUX.2's transformer with its guidance
embedder, and the same tiny FLUX.2 VAE and scheduler as the klein fixture.

The real checkpoint's ``tokenizer`` folder holds a ``PixtralProcessor``, which transformers builds only with
torchvision; the pipeline's prompt path uses nothing of it but its tokenizer's chat template, so the fixture saves
the tokenizer alone and ``TINY_OVERRIDES["flux2"]`` loads it with ``AutoTokenizer``."""

from __future__ import annotations

import json
from pathlib import Path

from .fixtures import TINY_OVERRIDES, _seeded, flux2_image_modules
from .tokenizers import QWEN_SENTENCES

# Mistral's control tokens as the chat template below writes them; [IMG]* are the Pixtral processor's image tokens.
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                          "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# A system turn, then user turns of text parts (images as one [IMG] each), the layout the real template writes.
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}"
)


def mistral_tokenizer():
    """A Llama-style BPE tokenizer (metaspace, as Mistral's) trained here with Mistral's control tokens (``<pad>``
    pads, on the right) and a Mistral-style chat template; trained on the pipeline's system message too, so that turn
    takes few of a short ``max_sequence_length``'s tokens and the prompt stays in."""
    import string

    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = [*string.ascii_letters, *string.digits, *string.punctuation, "\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=MISTRAL_SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([*QWEN_SENTENCES, SYSTEM_MESSAGE], trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = LlamaTokenizer(vocab=model["vocab"], merges=merges, add_prefix_space=False)
    tokenizer.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": MISTRAL_SPECIAL_TOKENS[4:]})
    tokenizer.padding_side = "right"
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def tiny_flux2(root: str | Path, seed: int = 0) -> Path:
    """FLUX.2 [dev] layout: a 30-layer Mistral3 language model 16 wide with a one-layer Pixtral vision tower (the
    prompt is the language model's hidden states at layers 10, 20 and 30, stacked: 48 wide), a one-double one-single
    block transformer with guidance embeddings, FLUX.2's VAE at scale 2 with non-trivial batch-norm statistics, and
    the real scheduler config."""
    import transformers
    from diffusers import Flux2Pipeline

    _seeded(seed)
    tokenizer = mistral_tokenizer()
    text_encoder = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=transformers.MistralConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=30,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                               vocab_size=512, max_position_embeddings=512),
        vision_config=transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                       num_attention_heads=2, head_dim=8, image_size=64,
                                                       patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1)).eval()
    transformer, vae, scheduler = flux2_image_modules(seed, guidance_embeds=True)
    Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                  transformer=transformer).save_pretrained(root)
    return Path(root)


# The fixture's tokenizer folder holds a bare tokenizer (module docstring); 64 tokens hold the system turn and a prompt.
TINY_OVERRIDES["flux2"] = [*TINY_OVERRIDES["flux2_klein"], "model.components.tokenizer.class=transformers.AutoTokenizer"]

__all__ = ["MISTRAL_CHAT_TEMPLATE", "mistral_tokenizer", "tiny_flux2"]
