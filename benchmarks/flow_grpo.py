"""What the RL benchmarks' trainer-style loops share: Flow-GRPO's SDE step with its log-prob (the loops' own, written
from the paper's formulas, float32), the prompts each repeat draws fresh, and the check that a loop and omnispec step
the same sigmas."""

from __future__ import annotations

import copy
import math
import time

import torch

from . import harness

NOISE_LEVEL = 0.7  # Flow-GRPO's default SDE noise level


def sde_step(v: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, nxt: torch.Tensor, sigma_max: torch.Tensor,
             noise: torch.Tensor | None = None, prev: torch.Tensor | None = None):
    """A loop's Flow-GRPO SDE step (float32): the next sample (drawn, or ``prev`` given) and its log-prob, the mean
    over every dimension but the batch's."""
    dt = nxt - sigma
    std = NOISE_LEVEL * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std * torch.sqrt(-dt)
    nxt_x = mean + scale * noise if prev is None else prev
    lp = -((nxt_x.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    return nxt_x, lp.mean(dim=tuple(range(1, lp.ndim)))


def walk(velocity, x, scheduler, steps: int, window: range, gen: torch.Generator, **schedule
         ) -> tuple[list, list[torch.Tensor], torch.Tensor]:
    """A loop's walk over ``scheduler``'s sigmas (``set_timesteps(steps, **schedule)``) from ``x``: ``velocity(x, t)``
    at each timestep, the SDE step on the ``window``'s steps (noise from ``gen``) and an Euler step elsewhere, as
    Flow-GRPO's fast trainers step. ``x`` is one tensor or a dict of streams (audio and video), and ``velocity``
    answers in kind; a step's log-prob is the streams' summed, as omnispec's rollouts sum them. Every state (the first
    included), the window steps' log-probs, and the sigmas."""
    scheduler.set_timesteps(steps, device=harness.DEVICE, **schedule)
    sigmas = scheduler.sigmas.to(harness.DEVICE, torch.float32)
    states, lps = [x], []
    for k, t in enumerate(scheduler.timesteps):
        v = velocity(x, t)
        streams, vs = (x, v) if isinstance(x, dict) else ({"": x}, {"": v})
        if k in window:
            drawn = {s: sde_step(vs[s], xs, sigmas[k], sigmas[k + 1], sigmas[1],
                                 noise=torch.randn(xs.shape, generator=gen, device=harness.DEVICE))
                     for s, xs in streams.items()}
            nxt = {s: d[0] for s, d in drawn.items()}
            lps.append(sum(d[1] for d in drawn.values()))
        else:
            nxt = {s: xs + (sigmas[k + 1] - sigmas[k]) * vs[s] for s, xs in streams.items()}
        x = nxt if isinstance(x, dict) else nxt[""]
        states.append(x)
    return states, lps, sigmas


def prompts(tag: str, n: int) -> list[str]:
    """``n`` prompts no earlier call drew (``tag`` differs per repeat), so no side reuses an encoding across repeats."""
    subjects = ["a cat", "a red car", "a bowl of fruit", "a lighthouse", "a city at night", "a dog on a beach",
                "a mountain lake", "a robot", "a forest path", "a teapot"]
    return [f"{subjects[i % len(subjects)]}, study {tag}-{i}" for i in range(n)]


def check_sigmas(pipe, scheduler, steps: int, request: dict, **schedule) -> float:
    """omnispec's walk and the loop's scheduler (``set_timesteps(steps, **schedule)``) step the same sigmas: their
    largest difference, which must be float32 rounding at most. Where diffusers warps a schedule (dynamic shift, a
    terminal stretch) it does so in float32 after rounding the step times, and omnispec in float64 before rounding
    the result, so the two can differ in the last bit (LTX-2's schedule); a step's cost does not depend on it."""
    from omnispec.runtime.run import Run

    ours = Run(pipe, pipe.request("probe", **request)).walks[0].steps.sigmas.cpu()
    scheduler = copy.deepcopy(scheduler)
    scheduler.set_timesteps(steps, **schedule)
    theirs = scheduler.sigmas.float().cpu()
    off = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else math.inf
    if off > 1e-6:
        raise SystemExit(f"omnispec steps sigmas {ours.tolist()}, the loop {theirs.tolist()}")
    return off


def timed(fn, *args) -> tuple[float, object]:
    """Seconds of ``fn(*args)`` between device syncs, and its result."""
    harness.sync()
    start = time.perf_counter()
    out = fn(*args)
    harness.sync()
    return time.perf_counter() - start, out


def module_seconds(entries: dict[str, tuple[object, str]], run) -> dict:
    """Seconds spent in each entry's ``(module, method)`` during one ``run`` (synchronised around each call), the
    run's total and what the entries leave (``other_s``). The calls are timed at the modules' own entry points,
    outside anything compiled, so a compiled VAE decoder is timed whole; modules a loop and omnispec share are timed
    on both."""
    spent = dict.fromkeys(entries, 0.0)

    def counted(key: str, call):
        def run_timed(*args, **kwargs):
            harness.sync()
            start = time.perf_counter()
            out = call(*args, **kwargs)
            harness.sync()
            spent[key] += time.perf_counter() - start
            return out

        return run_timed

    for key, (owner, method) in entries.items():
        setattr(owner, method, counted(key, getattr(owner, method)))  # an instance attribute before the class's method
    try:
        with torch.no_grad():
            total, _ = timed(run)
    finally:
        for owner, method in entries.values():
            delattr(owner, method)
    return spent | {"total_s": total, "other_s": total - sum(spent.values())}


def profiled_rollout(run) -> dict:
    """One rollout under torch.profiler: its kernels grouped by kind, in ms per rollout, and the largest ones."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if harness.DEVICE == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        total, _ = timed(run)
    return {"wall_s": total, **harness.kernel_summary(prof, 1, "_per_rollout", largest=20)}
