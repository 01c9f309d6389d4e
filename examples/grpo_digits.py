"""GRPO on the embedded digits model: a LoRA learns to draw the prompted digit more clearly, on a CPU.

``python grpo_digits.py [--iterations 30] [--out grpo_log.json] [--plot grpo.png]``, from any folder, after
``pip install 'omnispec-diffusion[examples]'`` (scikit-learn for the reward, matplotlib for ``--plot``).

Reward: the probability a digit classifier (an SVC trained on scikit-learn's digits, as in
``benchmarks.digits_quality``) gives the prompted digit. Each iteration: rollouts of ``prompts x group``
samples with Flow-GRPO's SDE on the first ``window`` steps (the rest stay deterministic, which is where
the class is decided anyway), group-normalised advantages, then a clipped-ratio
policy-gradient step over the stored steps, replayed through ``Pipeline.log_prob`` with gradients, plus an
optional KL to the reference model (the same DiT with the LoRA switched off), ``omnispec.rl.kl``: Flow-GRPO's
KL term. Guidance is off so that the starting policy has room to improve. ``--outside-every K`` computes only
one deterministic step in K outside the window (the sampler's ``outside_window``; window steps stay exact).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def reward_model():
    from omnispec.src_models.digits.reward import digit_reward

    return digit_reward()


def missing_packages(plot: bool) -> list[str]:
    """The packages this run needs that are not installed (checked before any training)."""
    needed = {"sklearn": "scikit-learn", "peft": "peft", **({"matplotlib": "matplotlib"} if plot else {})}
    return [package for module, package in needed.items() if importlib.util.find_spec(module) is None]


def overrides(steps: int, noise_level: float, window: int | None, outside_every: int) -> list[str]:
    """The digits spec, guidance off, with Flow-GRPO's SDE on the first ``window`` steps (None: all but the last)."""
    where = "{kind: all}" if window is None else f"{{kind: fixed, start: 0, length: {window}}}"
    return ["runtime.progress=false", f"recipe.defaults.steps={steps}", "recipe.phases.0.guidance.terms=[]",
            f"recipe.phases.0.sampler={{kind: sde, noise_level: {noise_level}, "
            f"outside_window: {{compute_every: {outside_every}}}, window: {where}}}"]


def train(iterations: int = 60, prompts_per_iter: int = 5, group: int = 8, steps: int = 10, lr: float = 1e-3,
          clip: float = 0.2, kl: float = 0.0, seed: int = 0, updates_per_iter: int = 2, noise_level: float = 0.7,
          window: int | None = 4, outside_every: int = 1, log=print) -> list[dict]:
    import omnispec
    from peft import LoraConfig

    torch.manual_seed(seed)
    rng = random.Random(seed)
    pipe = omnispec.build("digits", overrides=overrides(steps, noise_level, window, outside_every))
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
        rollout_s = time.time() - start
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
                    step_kl = omnispec.rl.kl(new, ref)[:, 0]  # Flow-GRPO's KL term for this step
                    loss = loss + kl * step_kl.mean()
                    kls.append(step_kl.mean().item())
                (loss / part.window).backward()
                ratios.append(ratio.detach())
                clipped.append(((ratio - 1).abs() > clip).float().mean().item())
            opt.step()
            pipe.weight_version += 1
        row = {"iteration": it, "reward": r.mean().item(), "ratio_mean": torch.cat(ratios).mean().item(),
               "ratio_max_dev": (torch.cat(ratios) - 1).abs().max().item(), "clip_fraction": float(np.mean(clipped)),
               "kl": float(np.mean(kls)) if kls else 0.0, "rollout_seconds": round(rollout_s, 3),
               "seconds": round(time.time() - start, 2)}
        history.append(row)
        log(json.dumps(row))
    return history


def compare_outside(every: int, seeds: list[int], out: Path | None, log=print, **kwargs) -> dict:
    """The reward curve of exact rollouts against ``outside_window: {compute_every: every}``, same iterations and
    seeds, then the rollout time of both, interleaved in this process (one rollout batch of the training size)."""
    import statistics

    import omnispec

    runs: dict[str, list[list[dict]]] = {"exact": [], f"every {every}": []}
    for seed in seeds:
        for label, k in (("exact", 1), (f"every {every}", every)):
            history = train(seed=seed, outside_every=k, log=lambda s: None, **kwargs)
            runs[label].append(history)
            if out:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"seed{seed}_every{k}.json").write_text(json.dumps({"kwargs": kwargs, "history": history}))
    pipes = {k: omnispec.build("digits", overrides=overrides(
        kwargs.get("steps", 10), kwargs.get("noise_level", 0.7), kwargs.get("window", 4), k)) for k in (1, every)}
    times: dict[int, list[float]] = {1: [], every: []}
    prompts = WORDS[: kwargs.get("prompts_per_iter", 5)]
    for r in range(12):
        for k, pipe in pipes.items():
            start = time.perf_counter()
            pipe.rollout(prompts, group_size=kwargs.get("group", 8), seed=r)
            times[k].append(time.perf_counter() - start)
    summary = {"rollout_seconds": {f"every {k}": statistics.median(v[2:]) for k, v in times.items()}}
    for label, histories in runs.items():
        rewards = np.array([[h["reward"] for h in history] for history in histories])
        blocks = [rewards[:, b:b + 10].mean(1) for b in range(0, rewards.shape[1], 10)]
        summary[label] = {"blocks_of_10": [[float(x.mean()), float(x.min()), float(x.max())] for x in blocks],
                          "first_5": rewards[:, :5].mean(1).tolist(), "last_10": rewards[:, -10:].mean(1).tolist()}
    log(json.dumps(summary))
    if out:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


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
    parser.add_argument("--window", type=int, default=4, help="stochastic steps (the first N); 0 = all but the last")
    parser.add_argument("--outside-every", type=int, default=1,
                        help="compute one deterministic step in K outside the window, reuse the prediction between")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the history as JSON (with --compare-outside: a directory)")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--compare-outside", type=int, metavar="K",
                        help="train exact and with --outside-every K for each of --seeds, then time both rollouts")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if missing := missing_packages(args.plot is not None):
        print(f"error: this example needs {', '.join(missing)}: pip install 'omnispec-diffusion[examples]'",
              file=sys.stderr)
        raise SystemExit(2)
    if args.compare_outside:
        compare_outside(args.compare_outside, args.seeds, args.out, iterations=args.iterations,
                        prompts_per_iter=args.prompts, group=args.group, steps=args.steps, lr=args.lr, kl=args.kl,
                        window=args.window or None)
        return
    history = train(args.iterations, args.prompts, args.group, args.steps, args.lr, kl=args.kl, seed=args.seed,
                    window=args.window or None, outside_every=args.outside_every)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "history": history},
                                       indent=1))
    if args.plot:
        plot(history, args.plot)


if __name__ == "__main__":
    main()
