"""The inductor heuristics the benchmarks try per row (benchmarks/inductor_heuristics.py): each decides as it says
inside its row and leaves the process as it was after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy
import torch
from torch._inductor import config
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from benchmarks import gpu_policies
from benchmarks.inductor_heuristics import applied, is_option


def _features(columns: int, hint: ReductionHint = ReductionHint.INNER) -> SimpleNamespace:
    return SimpleNamespace(reduction_numel=sympy.Integer(columns), numel=sympy.Integer(4608),
                           get_reduction_hint=lambda: hint)


@pytest.fixture
def graph():
    """The part of a graph under lowering that the persistence rule reads: sizes known statically."""
    sizes = SimpleNamespace(statically_known_leq=lambda a, b: a <= b, optimization_hint=lambda n: n)
    with V.set_graph_handler(SimpleNamespace(sizevars=sizes)):
        yield


def test_persistent_rows_keeps_a_norm_over_3072_columns_in_one_pass_and_leaves_other_reductions_to_inductor(graph):
    own = V.choices.should_use_persistent_reduction
    assert own(_features(1024), False) and not own(_features(3072), False)  # inductor's rule stops at 1,024
    with applied("regional+persistent_rows=4096") as options:
        assert options == ["persistent_rows=4096"]
        rule = V.choices.should_use_persistent_reduction
        assert rule(_features(3072), False) and rule(_features(4096), False)
        assert not rule(_features(8192), False)
        assert not rule(_features(3072), True), "a cooperative reduction is inductor's to decide"
        assert not rule(_features(3072, ReductionHint.OUTER), False)
        with config.patch({"triton.persistent_reductions": False}):
            assert not rule(_features(3072), False)
    assert not V.choices.should_use_persistent_reduction(_features(3072), False)


def test_descent_tuning_is_on_and_the_graph_caches_off_only_inside_its_row():
    before = (config.coordinate_descent_tuning, config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
    with applied("regional+cudagraphs+descent_tuning"):
        assert config.coordinate_descent_tuning and config.coordinate_descent_check_all_directions
        assert not config.fx_graph_cache and not torch._functorch.config.enable_autograd_cache
    assert (config.coordinate_descent_tuning, config.fx_graph_cache,
            torch._functorch.config.enable_autograd_cache) == before
    with applied("regional+cudagraphs") as options:  # no heuristic: nothing changes
        assert options == [] and config.fx_graph_cache == before[1]


def test_a_bad_row_count_is_refused_and_heuristics_are_not_compile_policy_fields():
    with pytest.raises(ValueError, match="persistent_rows=4096"):
        with applied("regional+persistent_rows=many"):
            pass
    assert is_option("persistent_rows=4096") and is_option("descent_tuning") and not is_option("cudagraphs")
    overrides = gpu_policies.compile_overrides("regional+cudagraphs+persistent_rows=4096+descent_tuning")
    assert overrides == ["policies.compile.mode=regional", "policies.compile.cudagraphs=true"]
