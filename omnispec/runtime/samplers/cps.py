"""Coefficient-preserving sampling (Wang & Yu, 2025, arXiv:2509.05952)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .stochastic import gaussian_log_prob, squared_error_log_prob


class CoefficientPreserving:
    """``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``, ``std = sigma_next sin(eta pi / 2)``, ``mean = (1 -
    sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1``; log-prob ``-(sample - mean)^2`` as Flow-GRPO and Flow-CPS score
    it (or the full Gaussian with ``log_prob: gaussian``)."""

    stochastic = True

    def transition(self, sampler: Any, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                   guard: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        std = sigma_next * math.sin(sampler.noise_level * math.pi / 2)
        x0, x1 = x - sigma * v, x + (1 - sigma) * v
        return x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std**2), std, std

    def log_prob(self, sampler: Any, sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        if sampler.log_prob == "squared_error":
            return squared_error_log_prob(sample, mean)
        return gaussian_log_prob(sample, mean, std)


CPS = CoefficientPreserving()
