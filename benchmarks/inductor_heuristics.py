"""Inductor's launch heuristics, changed for one benchmark row (experiments, not policies).

A compiled FLUX.1-dev step spends 5.3 ms a step in inductor's own kernels; the largest, each single block's
concatenation, LayerNorm and modulation, takes 57 µs a call where moving its bytes once would take about 20
(BENCHMARKS.md, issue 27, eighteenth session). Inductor writes a norm over 3,072 columns as a looped reduction, which
reads each row twice (sums, then output), because its rule keeps a row in registers (a persistent reduction, one
read) only up to 1,024 columns; omnispec's ``fixed_reductions`` then picks the loop's launch by rule. cache-dit
turns on coordinate-descent tuning instead, which times launch shapes at each kernel's first launch. Each option
here is a variant token of the benchmarks' ``--compile-variants`` / ``--omnispec-compile`` (``+persistent_rows=4096``,
``+descent_tuning``), applied around that row by ``applied``:

- ``persistent_rows=N``: an inner reduction over at most N elements is persistent. A rule, so it keeps
  ``fixed_reductions``' promise (the same kernel for a rollout and its replay), where timing would not.
- ``descent_tuning``: inductor's coordinate-descent tuning in all directions, as cache-dit sets it. Under
  ``fixed_reductions`` inductor tunes only its pointwise kernels (their numbers do not depend on the launch).

Inductor's graph caches do not key a choices handler, so a row with any of these compiles without them (its
kernels' own cache is keyed by their code).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

OPTIONS = ("persistent_rows", "descent_tuning")


def is_option(token: str) -> bool:
    """Whether a variant's ``+token`` is one of these heuristics (not a compile policy field)."""
    return token.split("=")[0] in OPTIONS


def _persistent_rows_choices(rows: int) -> Any:
    """Inductor's heuristics with inner reductions over at most ``rows`` elements made persistent."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        def should_use_persistent_reduction(self, features: Any, cooperative_reduction: bool) -> bool:
            if (config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, rows)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    return PersistentRows()


@contextlib.contextmanager
def applied(variant: str) -> Iterator[list[str]]:
    """Inside: ``variant``'s heuristic options (``regional+cudagraphs+persistent_rows=4096``) in force for whatever
    compiles and first launches its kernels there; yields the options applied (none: nothing changes)."""
    options = [token for token in variant.split("+")[1:] if is_option(token)]
    if not options:
        yield []
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.virtualized import V

    patches: dict[str, Any] = {"fx_graph_cache": False}
    choices = contextlib.nullcontext()
    for option in options:
        name, _, value = option.partition("=")
        if name == "descent_tuning":
            patches.update(coordinate_descent_tuning=True, coordinate_descent_check_all_directions=True)
        elif name == "persistent_rows":
            if not value.isdigit():
                raise ValueError(f"persistent_rows takes a number of elements, as in persistent_rows=4096: {option!r}")
            choices = V.set_choices_handler(_persistent_rows_choices(int(value)))
    with functorch_config.patch(enable_autograd_cache=False), config.patch(patches), choices:
        yield options
