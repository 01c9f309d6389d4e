"""MixGRPO, GRPO-Guard or DiffusionNFT on the embedded digits model: a LoRA learns to draw the prompted digit, on
a CPU.

``python rl_algorithms_digits.py --algorithm mixgrpo|grpo_guard|nft [--iterations 40] [--out log.json]``, from
any folder, after ``pip install 'omnispec-diffusion[examples]'`` (scikit-learn for the reward).

The reward is ``grpo_digits.py``'s: the probability a digit classifier gives the prompted digit; advantages are
normalised within each prompt's group.

- ``mixgrpo``: MixGRPO's sliding window. Flow-GRPO's SDE runs on a window of ``--window`` steps that moves by its
  length every ``--every`` iterations (``window: {kind: sliding, ...}``, the iteration passed in the sampler);
  the other steps are ODE steps (``--flash``: DPM-Solver++ after the window, MixGRPO-Flash's; ``--compress 0.5``:
  half the steps after the window, each larger, as MixGRPO-Flash compresses them), and only the window's steps are
  replayed and trained (clipped ratios).
- ``grpo_guard``: Flow-GRPO's SDE on the first ``--window`` steps, two optimizer steps per rollout batch, and
  GRPO-Guard's regulated ratio (``omnispec.rl.guard_log_ratio``) in the clipped objective; the old transition
  means come from one replay without gradients right after the rollout.
- ``nft``: DiffusionNFT. An ODE rollout (a ``cps`` window on the last step only, whose std is 0, records the clean
  latents), then forward-process training: per sample, noise levels of the sampling schedule, ``x_t`` built from
  the clean latents, the current and the old policy's velocities there (``omnispec.rl.denoiser``) and
  ``omnispec.rl.nft_loss``; the old policy follows the current one with DiffusionNFT's growing decay.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ALGORITHMS = ("mixgrpo", "grpo_guard", "nft")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]
DEFAULT_LR = {"mixgrpo": 2e-3, "grpo_guard": 1e-3, "nft": 3e-3}


def missing_packages() -> list[str]:
    needed = {"sklearn": "scikit-learn", "peft": "peft"}
    return [package for module, package in needed.items() if importlib.util.find_spec(module) is None]


def sampler(algorithm: str, iteration: int, steps: int, window: int, every: int, noise_level: float,
            flash: bool = False, compress: float = 1.0) -> dict:
    """The rollout's sampler at this training iteration."""
    if algorithm == "mixgrpo":
        return {"kind": "sde", "noise_level": noise_level,
                "window": {"kind": "sliding", "length": window, "every": every, "iteration": iteration,
                           "wrap": True},
                "outside_window": {"solver": "dpmsolver++" if flash else "euler", "compress": compress}}
    if algorithm == "grpo_guard":
        return {"kind": "sde", "noise_level": noise_level, "window": {"kind": "fixed", "start": 0, "length": window}}
    return {"kind": "cps", "include_last": True, "window": {"kind": "fixed", "start": steps - 1, "length": 1}}


def group_advantages(reward: torch.Tensor, prompts: int) -> torch.Tensor:
    grouped = reward.view(prompts, -1)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()


def train(algorithm: str = "mixgrpo", iterations: int = 40, prompts_per_iter: int = 4, group: int = 6,
          steps: int = 8, lr: float | None = None, clip: float = 0.2, window: int = 2, every: int = 10,
          noise_level: float = 0.7, nft_steps: int = 2, beta: float = 1.0, seed: int = 0, flash: bool = False,
          compress: float = 1.0, log=print) -> list[dict]:
    """Train and return one row per iteration (its mean reward and the algorithm's own numbers)."""
    from peft import LoraConfig

    import omnispec

    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pipe = omnispec.build("digits", overrides=["runtime.progress=false", f"recipe.defaults.steps={steps}",
                                               "recipe.phases.0.guidance.terms=[]"])
    dit = pipe.components["transformer"]
    dit.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS), adapter_name="policy")
    params = [p for p in dit.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr or DEFAULT_LR[algorithm])
    old_params = [p.detach().clone() for p in params]  # DiffusionNFT's old policy
    from omnispec.src_models.digits.reward import digit_reward

    reward = digit_reward()
    gen = torch.Generator().manual_seed(seed)
    history = []
    for it in range(iterations):
        start = time.time()
        digits = rng.sample(range(10), prompts_per_iter)
        ro = pipe.rollout([WORDS[d] for d in digits], group_size=group, seed=seed * 100_000 + it * 1000,
                          sampler=sampler(algorithm, it, steps, window, every, noise_level, flash, compress))
        r = reward(ro.array, [digits[int(g)] for g in ro.group_ids])
        adv = group_advantages(r, prompts_per_iter)
        row = {"iteration": it, "reward": r.mean().item()}
        if algorithm == "nft":
            row.update(_nft_update(pipe, ro, adv, params, old_params, opt, it, nft_steps, beta, gen))
        else:
            row.update(_grpo_update(pipe, ro, adv, opt, clip, guard=algorithm == "grpo_guard"))
        row["seconds"] = round(time.time() - start, 2)
        history.append(row)
        log(json.dumps(row))
    return history


def _grpo_update(pipe, ro, adv: torch.Tensor, opt, clip: float, guard: bool) -> dict:
    """Clipped policy-gradient steps over the rollout's window (two subsets, so the second is off-policy)."""
    import omnispec

    old = pipe.log_prob(ro, grad=False) if guard else None  # the rollout's transition means, for the guard
    ratios = []
    for subset in torch.arange(len(ro.prompts)).chunk(2):
        opt.zero_grad(set_to_none=True)
        part = ro.select(subset)
        for k in range(part.window):
            new = pipe.log_prob(part, steps=[k], grad=True)
            if guard:
                log_ratio = omnispec.rl.guard_log_ratio(new, old.select(subset, [k]))[:, 0]
            else:
                log_ratio = new.log_probs[:, 0] - part.log_probs[:, k]
            ratio = log_ratio.exp()
            (omnispec.rl.clipped_surrogate(ratio, adv[subset], clip) / part.window).backward()
            ratios.append(ratio.detach())
        opt.step()
        pipe.weight_version += 1
    ratio = torch.cat(ratios)
    return {"window": ro.step_indices[0].tolist(), "ratio_mean": ratio.mean().item(),
            "clip_fraction": ((ratio - 1).abs() > clip).float().mean().item()}


def _nft_update(pipe, ro, adv: torch.Tensor, params, old_params, opt, it: int, count: int, beta: float,
                gen: torch.Generator) -> dict:
    """DiffusionNFT's update: ``count`` noise levels per sample, one optimizer step, then the old policy's decay."""
    import omnispec

    denoiser = omnispec.rl.denoiser(pipe, ro)
    x0 = ro.latents[:, -1]  # the ODE's clean latents (the last step's cps draw, std 0)
    at = omnispec.rl.nft_steps(len(x0), len(denoiser.steps), count, gen)
    opt.zero_grad(set_to_none=True)
    losses = []
    for col in range(count):
        steps = torch.tensor(denoiser.steps)[at[:, col]]
        sigma = denoiser.sigmas(steps)
        x_t = omnispec.rl.nft_noised(x0, sigma, torch.randn(x0.shape, generator=gen))
        with torch.no_grad(), _weights(params, old_params):
            v_old = denoiser.predict(x_t, steps)["latents"]
        v = denoiser.predict(x_t, steps)["latents"]
        out = omnispec.rl.nft_loss(x0, x_t, sigma, v, v_old, adv, beta=beta)
        (out.loss / count).backward()
        losses.append(out.loss.item())
    opt.step()
    pipe.weight_version += 1
    decay = min(0.001 * it, 0.5)  # DiffusionNFT's first decay schedule: the old policy lags more as training goes
    with torch.no_grad():
        for p, o in zip(params, old_params):
            o.mul_(decay).add_(p.detach(), alpha=1 - decay)
    return {"nft_loss": float(np.mean(losses))}


@contextlib.contextmanager
def _weights(params, values):
    """The LoRA's parameters set to ``values`` inside the block (the old policy), restored after."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="mixgrpo")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--window", type=int, default=2, help="stochastic steps (mixgrpo, grpo_guard)")
    parser.add_argument("--every", type=int, default=10, help="mixgrpo: iterations between window moves")
    parser.add_argument("--lr", type=float, help=f"default {DEFAULT_LR}")
    parser.add_argument("--flash", action="store_true", help="mixgrpo: DPM-Solver++ after the window (MixGRPO-Flash)")
    parser.add_argument("--compress", type=float, default=1.0,
                        help="mixgrpo: the fraction of the points after the window kept (MixGRPO-Flash), in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the history as JSON")
    args = parser.parse_args()
    if missing := missing_packages():
        print(f"error: this example needs {', '.join(missing)}: pip install 'omnispec-diffusion[examples]'",
              file=sys.stderr)
        raise SystemExit(2)
    for name in ("iterations", "prompts", "group", "steps", "window", "every"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            raise SystemExit(2)
    if not 0 < args.compress <= 1:
        print("error: --compress must be in (0, 1]", file=sys.stderr)
        raise SystemExit(2)
    history = train(args.algorithm, args.iterations, args.prompts, args.group, args.steps, args.lr,
                    window=args.window, every=args.every, seed=args.seed, flash=args.flash,
                    compress=args.compress)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "history": history},
                                       indent=1))


if __name__ == "__main__":
    main()
