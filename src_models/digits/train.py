"""Train the embedded digits model on scikit-learn's handwritten digits (1797 real 8x8 images).

``python -m src_models.digits.train [--steps N] [--out DIR] [--seed S]``: deterministic for a seed on a
CPU; a few minutes on 2 cores. Rectified flow: ``x_t = (1 - t) x0 + t noise``, the DiT regresses the
velocity ``noise - x0``; 15% of prompts are dropped to "" so classifier-free guidance has an
unconditional model to push against. The weights written are an EMA of the trained ones.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .model import DigitsDiT, DigitsTextEncoder

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["{w}", "{d}", "the digit {w}", "the digit {d}", "a handwritten {w}", "a handwritten {d}",
             "number {w}", "the number {d}", "digit {d}", "a {w}"]
MAX_LENGTH = 8
IMAGE_SIZE = 32
WEIGHTS = Path(__file__).parent / "weights"


def prompts_for(digit: int) -> list[str]:
    return [t.format(w=WORDS[digit], d=digit) for t in TEMPLATES]


def build_tokenizer():
    """A word-level tokenizer trained with ``tokenizers`` on every training prompt; BOS starts each prompt."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([p for d in range(10) for p in prompts_for(d)],
                            trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[BOS]"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                  model_max_length=MAX_LENGTH)
    return out


def load_images() -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as 1x32x32 in [-1, 1] (bright ink on dark ground, as in the data set) and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 8.0 - 1.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x, torch.tensor(data.target)


def tokenize(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(prompts, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def train(steps: int = 3000, batch: int = 96, seed: int = 0, out: Path = WEIGHTS, lr: float = 1e-3,
          drop: float = 0.15, log_every: int = 250) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    images, labels = load_images()
    tokenizer = build_tokenizer()
    text = DigitsTextEncoder(vocab_size=len(tokenizer))
    dit = DigitsDiT()
    params = list(text.parameters()) + list(dit.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * (0.1 + 0.9 * (1 - s / steps)))
    ema_text, ema_dit = copy.deepcopy(text).requires_grad_(False), copy.deepcopy(dit).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    start, history = time.time(), []
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        x0 = images[idx]
        prompts = ["" if rng.random() < drop else rng.choice(prompts_for(int(d))) for d in labels[idx]]
        ids, mask = tokenize(tokenizer, prompts)
        t = torch.sigmoid(torch.randn(batch, generator=gen))  # logit-normal, as SD3 trains
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * noise
        pred = dit(xt, t * 1000.0, text(ids, mask))[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for ema, live in ((ema_text, text), (ema_dit, dit)):
                for pe, pl in zip(ema.parameters(), live.parameters()):
                    pe.lerp_(pl, 1 - decay)
        if step % log_every == 0 or step == steps - 1:
            history.append({"step": step, "loss": round(loss.item(), 5), "seconds": round(time.time() - start, 1)})
            print(json.dumps(history[-1]), flush=True)
    out = Path(out)
    ema_dit.save_pretrained(out / "transformer")
    ema_text.save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "training.json").write_text(json.dumps({"steps": steps, "batch": batch, "seed": seed, "lr": lr,
                                                    "label_dropout": drop, "history": history}, indent=1))
    return {"history": history, "seconds": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    args = parser.parse_args()
    np.random.seed(args.seed)
    train(args.steps, args.batch, args.seed, args.out, args.lr)


if __name__ == "__main__":
    main()
