"""DanceGRPO's SDE (Xue et al., 2025, arXiv:2505.07818), Gaussian log-prob."""

from __future__ import annotations

from typing import Any

import torch

from .stochastic import gaussian_log_prob


class DanceSDE:
    """``std = eta sqrt(-dt)``, ``mean = x + v dt - eta^2 / 2 * score * dt`` with ``score = -(x - (1 - sigma) x0) /
    sigma^2`` and ``x0 = x - sigma v``."""

    stochastic = True

    def transition(self, sampler: Any, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                   guard: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        dt = sigma_next - sigma
        std = sampler.eta * torch.sqrt(-dt)
        x0 = x - sigma * v
        score = -(x - x0 * (1 - sigma)) / sigma**2
        return x + dt * v - 0.5 * sampler.eta**2 * score * dt, std, torch.full_like(std, sampler.eta)

    def log_prob(self, sampler: Any, sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        return gaussian_log_prob(sample, mean, std)


DANCE_SDE = DanceSDE()
