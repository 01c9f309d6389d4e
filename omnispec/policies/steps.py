"""The policies the denoise loop consults at every step, behind one protocol (``StepPolicy``), so that the step body
(``runtime/run.py``) names none of them: a step cache decides which steps compute and scopes each pass's forward; the
modulation table is installed around a step's forwards. A policy overrides the hooks it needs; ``StepPolicies`` is
all of a pipeline's, consulted as one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any


class StepPolicy:
    """What a policy may do at each step of a request. ``run`` is the request's ``runtime.run.Run`` (its
    ``scratch`` dict keeps what a policy remembers for that request, keyed by the policy); ``walk`` and
    ``phase_run`` are the plan's walk and the phase that owns the step; ``step`` its index in the walk (its plan:
    ``phase_run.plans[step]``)."""

    # Whether forwards run one per (pass, sample), each under ``pass_context``: a hooked cache's decisions then never
    # depend on batch-mates or other passes.
    separate_passes: bool = False

    def begin(self, steps: Mapping[str, int]) -> None:
        """A request starts in which denoiser ``name`` runs ``steps[name]`` steps."""

    def computes(self, step: int) -> bool:
        """Whether step ``step`` runs the denoiser (else it reuses the last prediction)."""
        return True

    def step_context(self, run: Any, walk: Any, phase_run: Any, step: int) -> AbstractContextManager:
        """Entered around a step's forwards (and a replay's)."""
        return nullcontext()

    def pass_context(self, denoiser: Any, name: str, **where: Any) -> AbstractContextManager:
        """Entered around one forward of ``separate_passes`` (``name``: the pass and the sample, "uncond:1";
        ``where``: step_index, num_inference_steps, timestep, sigma)."""
        return nullcontext()


class StepPolicies(StepPolicy):
    """A pipeline's step policies, consulted as one."""

    def __init__(self, policies: Sequence[StepPolicy] = ()):
        self.policies = tuple(policies)
        self.separate_passes = any(p.separate_passes for p in self.policies)

    def __bool__(self) -> bool:
        return bool(self.policies)

    def begin(self, steps: Mapping[str, int]) -> None:
        for policy in self.policies:
            policy.begin(steps)

    def computes(self, step: int) -> bool:
        return all(policy.computes(step) for policy in self.policies)

    def step_context(self, run: Any, walk: Any, phase_run: Any, step: int) -> AbstractContextManager:
        return _all(policy.step_context(run, walk, phase_run, step) for policy in self.policies)

    def pass_context(self, denoiser: Any, name: str, **where: Any) -> AbstractContextManager:
        return _all(policy.pass_context(denoiser, name, **where) for policy in self.policies)


@contextmanager
def _all(contexts: Iterable[AbstractContextManager]) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
