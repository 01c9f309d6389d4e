"""``RLPipeline``: a ``Pipeline`` with rollouts and replay as methods (what ``omnispec.build`` returns).

It lives on the trainer side so that the runtime never imports ``omnispec.rl``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..runtime.pipeline import Pipeline
from .rollout import Replay, Rollout, log_prob, rollout


class RLPipeline(Pipeline):
    def rollout(self, prompts: str | Sequence[str], group_size: int = 1, seed: int = 0, sampler: Any = None,
                shared_noise: bool = False, **request: Any) -> Rollout:
        """Batched SDE rollouts with per-step log-probs; see ``omnispec.rl.rollout``."""
        return rollout(self, prompts, group_size, seed, sampler, shared_noise, **request)

    def log_prob(self, rollout: Rollout, steps: Sequence[int] | None = None, grad: bool = True,
                 micro_batch: int | None = None, exact: bool = True) -> Replay:
        """Replay stored transitions through the same code, with gradients; see ``omnispec.rl.log_prob``."""
        return log_prob(self, rollout, steps, grad, micro_batch, exact)
