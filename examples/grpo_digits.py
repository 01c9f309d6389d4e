"""GRPO on the embedded digits model: a LoRA learns to draw the prompted digit more clearly, on a CPU.

``python examples/grpo_digits.py [--iterations 30] [--out grpo_log.json] [--plot grpo.png]``

Reward: the probability a digit classifier (an SVC trained on scikit-learn's digits, as in
``benchmarks.digits_quality``) gives the prompted digit. Each iteration: rollouts of ``prompts x group``
samples with Flow-GRPO's SDE on the first ``window`` steps (the rest stay deterministic, which is where
the class is decided anyway; see BENCHMARKS.md), group-normalised advantages, then a clipped-ratio
policy-gradient step over the stored steps, replayed through ``Pipeline.log_prob`` with gradients, plus an
optional KL to the reference model (the same DiT with the LoRA switched off). Guidance is off so that the
starting policy has room to improve.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def reward_model():
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    from benchmarks.digits_quality import to_8x8

    data = load_digits()
    clf = SVC(gamma=0.001, C=10.0, probability=True, random_state=0).fit(data.data, data.target)

    def reward(array: np.ndarray, digits: list[int]) -> torch.Tensor:
        probs = clf.predict_proba(to_8x8(array).reshape(len(array), -1))
        return torch.tensor([probs[i, d] for i, d in enumerate(digits)], dtype=torch.float32)

    return reward


def train(iterations: int = 60, prompts_per_iter: int = 5, group: int = 8, steps: int = 10, lr: float = 1e-3,
          clip: float = 0.2, kl: float = 0.0, seed: int = 0, updates_per_iter: int = 2, noise_level: float = 0.7,
          window: int | None = 4, log=print) -> list[dict]:
    import omnispec
    from peft import LoraConfig

    torch.manual_seed(seed)
    rng = random.Random(seed)
    pipe = omnispec.build(ROOT / "specs" / "digits.yaml", overrides=[
        "runtime.progress=false", f"recipe.defaults.steps={steps}", "recipe.phases.0.guidance.terms=[]",
        f"recipe.phases.0.sampler={{kind: sde, noise_level: {noise_level}, window: "
        + ("{kind: all}}" if window is None else f"{{kind: fixed, start: 0, length: {window}}}}}")])
    dit = pipe.components["transformer"]
    dit.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]),
                    adapter_name="grpo")
    params = [p for p in dit.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    reward = reward_model()
    history = []
    for it in range(iterations):
        start = time.time()
        digits = rng.sample(range(10), prompts_per_iter)
        ro = pipe.rollout([WORDS[d] for d in digits], group_size=group, seed=seed * 100_000 + it * 1000)
        r = reward(ro.array, [digits[int(g)] for g in ro.group_ids])
        grouped = r.view(prompts_per_iter, group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        ratios, clipped, kls = [], [], []
        # Several optimizer steps per rollout batch (over disjoint sample subsets), so that later subsets are
        # replayed by an updated policy and the clipped ratio does its job.
        for subset in torch.arange(len(r)).chunk(updates_per_iter):
            opt.zero_grad(set_to_none=True)
            part = ro.select(subset)
            for k in range(part.window):
                new = pipe.log_prob(part, steps=[k], grad=True)
                ratio = torch.exp(new.log_probs[:, 0] - part.log_probs[:, k])
                a = adv[subset]
                loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a).mean()
                if kl:
                    with torch.no_grad(), omnispec.rl.reference(pipe):
                        ref = pipe.log_prob(part, steps=[k], grad=False)
                    diff = (new.means[:, 0] - ref.means[:, 0]).flatten(1)
                    step_kl = (diff**2).mean(1) / (2 * new.stds[:, 0] ** 2)
                    loss = loss + kl * step_kl.mean()
                    kls.append(step_kl.mean().item())
                (loss / part.window).backward()
                ratios.append(ratio.detach())
                clipped.append(((ratio - 1).abs() > clip).float().mean().item())
            opt.step()
            pipe.weight_version += 1
        row = {"iteration": it, "reward": r.mean().item(), "ratio_mean": torch.cat(ratios).mean().item(),
               "ratio_max_dev": (torch.cat(ratios) - 1).abs().max().item(), "clip_fraction": float(np.mean(clipped)),
               "kl": float(np.mean(kls)) if kls else 0.0, "seconds": round(time.time() - start, 2)}
        history.append(row)
        log(json.dumps(row))
    return history


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [h["iteration"] for h in history]
    rewards = [h["reward"] for h in history]
    smooth = np.convolve(rewards, np.ones(5) / 5, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(it, rewards, alpha=0.4, label="mean reward")
    ax.plot(it[4:], smooth, label="5-iteration mean")
    ax.set_xlabel("iteration")
    ax.set_ylabel("P(prompted digit)")
    ax.set_title("GRPO on the digits model (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=4, help="stochastic steps (the first N); 0 = all")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    history = train(args.iterations, args.prompts, args.group, args.steps, args.lr, kl=args.kl, seed=args.seed,
                    window=args.window or None)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "history": history},
                                       indent=1))
    if args.plot:
        plot(history, args.plot)


if __name__ == "__main__":
    main()
