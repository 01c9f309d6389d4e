"""Flow-GRPO's SDE (Liu et al., 2025, arXiv:2505.05470), Gaussian log-prob."""

from __future__ import annotations

from typing import Any

import torch

from .stochastic import gaussian_log_prob


class FlowGRPO:
    """``std_t = eta sqrt(sigma / (1 - sigma))``, ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 -
    sigma) / (2 sigma)) dt``, ``std = std_t sqrt(-dt)`` with ``dt = sigma_next - sigma``."""

    stochastic = True

    def transition(self, sampler: Any, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                   guard: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        dt = sigma_next - sigma
        std_t = torch.sqrt(sigma / (1 - torch.where(sigma >= 1, guard, sigma))) * sampler.noise_level
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std_t * torch.sqrt(-dt), std_t

    def log_prob(self, sampler: Any, sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        return gaussian_log_prob(sample, mean, std)


SDE = FlowGRPO()
