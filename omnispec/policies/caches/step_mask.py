"""A declared compute/reuse pattern (which diffusers lacks): ``mask[i]`` false reuses the last prediction at step
``i``. Read by the denoise loop; no hooks, so forwards stay batched and stochastic steps that compute replay
exactly."""

from typing import Any

from .base import Cache


class StepMask(Cache):
    scoped = False

    def computes(self, policy: Any, step: int) -> bool:
        return step >= len(policy.mask) or policy.mask[step]


STEP_MASK = StepMask()
