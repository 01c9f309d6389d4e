"""Norms that read their rows once (``policies.compile.persistent_rows``).

Inductor writes a reduction along a row either as a persistent kernel, which holds the whole row in registers and
reads it once, or as a looped one, which reads the row once for its sums and again for the output. Its rule makes a
row persistent only up to 1,024 elements (``InductorChoices.should_use_persistent_reduction``, torch 2.11 to 2.13),
and the norms of FLUX, SD3.5, Wan and Qwen-Image run over rows of 1,536 to 5,120, so compiled they read their bytes
twice. ``persistent_rows: N`` raises that bound to N for inner reductions; omnispec's inductor compiles raise it to
4,096 unless told otherwise (what it gives: BENCHMARKS.md, "Inductor options: eager rounding, fixed reductions, rows
read once").

Inductor's config has no key for that bound, and its heuristics live in one object per thread (``V.choices``). So
the bound rides with the compile as a post-grad pass (``PersistentRows``), the one per-compile object inductor both
carries through a compile's lowering and keys its caches by; the pass changes no graph, and puts ``RowChoices`` on
the compiling thread, whose rule reads the bound from the pass of the compile in progress and otherwise decides as
inductor does. A compile without the pass (anyone else's, or omnispec's with ``persistent_rows: 1024``) keeps
inductor's rule. It is a rule, not a timing: a rollout and its replay get the same kernels. Triton kernels only
(CUDA); inductor's CPU code does not ask.
"""

from __future__ import annotations

import logging
from typing import Any

import sympy

from .inductor_passes import cache_key, installed
from .torch_internals import CustomGraphPass, InductorChoices, MemoryDep, ReductionHint, V
from .torch_internals import inductor_config as config

log = logging.getLogger(__name__)


class RowChoices(InductorChoices):
    """Inductor's heuristics, with inner reductions up to the compile's ``persistent_rows`` made persistent."""

    def should_use_persistent_reduction(self, features: Any, cooperative_reduction: bool) -> bool:
        rows = getattr(config.post_grad_custom_post_pass, "persistent_rows", None)
        if (rows and config.triton.persistent_reductions and not cooperative_reduction
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, rows) and _along_rows(features)):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)


def _along_rows(features: Any) -> bool:
    """Whether the kernel's reduction runs along memory's rows. Inductor's hint says so (INNER) unless a read in
    the reduction is indexed by a value: FLUX's double blocks' second norms add the gated attention output first,
    the gate read from the modulation table by the step's row, and inductor then calls the reduction DEFAULT (it
    decides on coalescing later, from tiling scores this rule is not given). Such a kernel counts when each of its
    reads and writes is contiguous, a constant, or of stride 1 in the last dimension (the tests inductor applies
    to a reduction kernel's pointwise parts)."""
    hint = features.get_reduction_hint()
    if hint == ReductionHint.INNER:
        return True
    if hint != ReductionHint.DEFAULT:
        return False
    deps = (dep for node in features.scheduler_nodes() for dep in (*node.read_writes.reads, *node.read_writes.writes))
    return all(not isinstance(dep, MemoryDep) or dep.is_contiguous() or isinstance(dep.index, (sympy.Integer, int))
               or dep.stride1_for_last_dim() for dep in deps)


def foreign_choices() -> str | None:
    """What stands in the way of ``RowChoices`` in this process: heuristics of someone else's, installed for every
    thread (``inductor_choices_class``) or on this one; None when there is nothing."""
    if config.inductor_choices_class is not None:
        return f"inductor's config.inductor_choices_class is set ({config.inductor_choices_class!r})"
    current = V.choices
    if type(current) not in (InductorChoices, RowChoices):
        return f"this thread's inductor heuristics are {type(current).__qualname__}"
    return None


class PersistentRows(CustomGraphPass):
    """Inductor's post-grad post-pass for one compile: carries ``persistent_rows`` (read by ``RowChoices``), runs
    ``then`` (what was installed process-wide before, kept), and changes nothing itself."""

    def __init__(self, persistent_rows: int, then: Any = None) -> None:
        self.persistent_rows = persistent_rows
        self.then = installed(then)

    def __call__(self, graph: Any) -> None:
        if type(V.choices) is InductorChoices:
            V.set_choices_handler(RowChoices())  # for this thread from now on; it decides as inductor does elsewhere
        elif not isinstance(V.choices, RowChoices):
            log.warning("compile.persistent_rows does not apply: %s", foreign_choices())
        for custom in self.then:
            custom(graph)

    def uuid(self) -> tuple[Any, ...] | None:
        return cache_key(__file__, self.then, self.persistent_rows)
