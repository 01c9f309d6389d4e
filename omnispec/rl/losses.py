"""Policy losses a trainer calls on what omnispec returns (replayed log-probs, transition means, predictions).

- ``clipped_surrogate``: PPO's clipped objective on per-sample ratios (Flow-GRPO, DanceGRPO, MixGRPO).
- ``guard_log_ratio``: GRPO-Guard's regulated log-ratio (Wang et al., 2025, arXiv:2510.22319) from two replays of
  the same transitions: the mean shift every Gaussian log-ratio carries is taken out, and the ratio is scaled by the
  transition std, so that clipping acts alike at every step and no step's gradients dominate.
- ``nft_*``: DiffusionNFT (Zheng et al., 2025, arXiv:2509.16117): forward-process training on clean samples, no
  log-probs; the loss contrasts the implicit positive and negative policies mixed from the current and old
  velocities.

Each is written from its paper's formulas and checked on the same inputs against a reference written from the
official trainer's arithmetic (tests/test_rl_algorithms.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..spec import SpecError
from .rollout import Replay, check_replay_pair


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor,
                      clip: float | tuple[float, float] = 0.2) -> torch.Tensor:
    """PPO's clipped objective as a loss: ``mean(max(-A r, -A clip(r, 1 - low, 1 + high)))``. ``clip`` is one
    range for both sides or ``(low, high)``; ``ratio`` and ``advantages`` broadcast (``(B,)`` or ``(B, K)``)."""
    low, high = (clip, clip) if isinstance(clip, (int, float)) else clip
    if low < 0 or high < 0:
        raise SpecError.single(f"clip ranges are distances from 1, >= 0; got {clip}", "clip")
    advantages = advantages.to(ratio.device, ratio.dtype)
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high)).mean()


def guard_log_ratio(new: Replay, old: Replay) -> torch.Tensor:
    """GRPO-Guard's regulated log-ratio ``(B, K)`` of the same replayed transitions under the trained weights
    (``new``, with gradients) and the weights that drew them (``old``: ``pipe.log_prob(ro, grad=False)`` before
    the first update, or the rollout's own weights otherwise).

    For a sample drawn as ``mean_old + s eps`` (``s`` the transition std), a Gaussian step's log-ratio is the
    element mean of ``eps d / s - d^2 / (2 s^2)`` with ``d = mean - mean_old``: its expectation is negative and
    grows as ``s`` shrinks, so the ratios of low-noise steps sit below 1, and its spread scales with ``1 / s``.
    Per stream, this returns ``s (log p - log p_old) + mean((mean - mean_old)^2) / (2 s)`` = ``mean(eps d)``: the
    log-ratio with that shift removed (RatioNorm) and multiplied by ``s`` (the gradient reweighting that evens the
    steps out), summed over streams; ``exp`` of it is the ratio to clip (``clipped_surrogate``). It needs Gaussian
    log-probs: ``sde``, ``dance_sde``, or ``cps`` with ``log_prob: gaussian``."""
    check_replay_pair(("new", new), ("old", old))
    total = None
    for s, mean in new.transition_means.items():
        ref = old.transition_means[s].to(mean.device)
        if ref.shape != mean.shape:
            raise SpecError.single(f"stream {s!r}: means of shape {tuple(ref.shape)}, the new replay's are "
                                   f"{tuple(mean.shape)}", "old")
        std = old.transition_stds[s].to(mean.device)
        shift = ((mean - ref) ** 2).mean(dim=tuple(range(2, mean.ndim)))
        lr = (new.stream_log_probs[s] - old.stream_log_probs[s].to(mean.device)) * std + shift / (2 * std)
        total = lr if total is None else total + lr
    assert total is not None
    return total


# ---- DiffusionNFT ---------------------------------------------------------------------------------------

def nft_steps(batch: int, steps: int, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(batch, count)`` schedule steps to train at: per sample, the first ``count`` of a random permutation of
    ``range(steps)`` (each sample trains at distinct noise levels of the sampling schedule, as DiffusionNFT does)."""
    if not 1 <= count <= steps:
        raise SpecError.single(f"expected 1 <= count <= steps ({steps}), got {count}", "count")
    return torch.stack([torch.randperm(steps, generator=generator)[:count] for _ in range(batch)])


def nft_noised(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The forward process of a flow model: ``x_t = (1 - sigma) x0 + sigma noise``, ``sigma`` per row."""
    s = sigma.to(x0.device, torch.float32).reshape(-1, *[1] * (x0.ndim - 1))
    return (1 - s) * x0.float() + s * noise.float()


@dataclass
class NFTLoss:
    loss: torch.Tensor  # scalar: what the trainer differentiates
    per_sample: torch.Tensor  # (B,) before the batch mean and the adv_clip scale
    positive: torch.Tensor  # (B,) the implicit positive policy's weighted x0 error
    negative: torch.Tensor  # (B,) the implicit negative policy's


def nft_loss(x0: torch.Tensor | Mapping[str, torch.Tensor], x_t: torch.Tensor | Mapping[str, torch.Tensor],
             sigma: torch.Tensor, v: torch.Tensor | Mapping[str, torch.Tensor],
             v_old: torch.Tensor | Mapping[str, torch.Tensor], advantages: torch.Tensor, *, beta: float = 1.0,
             adv_clip: float = 5.0) -> NFTLoss:
    """DiffusionNFT's loss at one noise level per sample.

    The advantage, clipped to ``[-adv_clip, adv_clip]``, becomes an optimality probability ``r = A / (2 adv_clip)
    + 1/2``. The implicit positive policy ``beta v + (1 - beta) v_old`` and negative policy ``(1 + beta) v_old -
    beta v`` each predict the clean sample ``x_t - sigma v``; each error ``|x0_hat - x0|^2`` is divided by its own
    mean absolute error (no gradient; the adaptive weight), and the loss is ``mean(r pos + (1 - r) neg) / beta``
    times ``adv_clip``. ``v_old`` is the old policy's prediction (no gradient), ``v`` the trained one's. Streams
    (dicts) add their per-sample losses. The KL to a reference, if wanted, is the trainer's
    ``kl_beta * mean((v - v_ref)^2)``."""
    if beta <= 0 or adv_clip <= 0:
        raise SpecError.single(f"beta and adv_clip must be > 0, got {beta} and {adv_clip}", "beta")
    streams = dict(x0) if isinstance(x0, Mapping) else {"latents": x0}
    pick = (lambda t, s: t[s]) if isinstance(x0, Mapping) else (lambda t, s: t)
    a = torch.clamp(advantages.float(), -adv_clip, adv_clip)
    r = torch.clamp(a / adv_clip / 2 + 0.5, 0, 1)
    positive = negative = None
    for s, clean in streams.items():
        xt, vs, vo = pick(x_t, s), pick(v, s), pick(v_old, s).detach()
        t = sigma.to(xt.device, torch.float32).reshape(-1, *[1] * (xt.ndim - 1))
        pos = _weighted_x0_error(xt - t * (beta * vs + (1 - beta) * vo), clean)
        neg = _weighted_x0_error(xt - t * ((1 + beta) * vo - beta * vs), clean)
        positive = pos if positive is None else positive + pos
        negative = neg if negative is None else negative + neg
    assert positive is not None and negative is not None
    r = r.to(positive.device, positive.dtype)
    per_sample = (r * positive + (1 - r) * negative) / beta
    return NFTLoss((per_sample * adv_clip).mean(), per_sample, positive, negative)


def _weighted_x0_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per row, ``mean((x0_hat - x0)^2) / w`` with ``w = max(mean|x0_hat - x0|, 1e-5)`` in float64 without
    gradient (DiffusionNFT's adaptive weight; the division is float64 as there)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        w = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
    return ((x0_hat - x0) ** 2 / w).mean(dim=dims)


__all__ = ["NFTLoss", "clipped_surrogate", "guard_log_ratio", "nft_loss", "nft_noised", "nft_steps"]
