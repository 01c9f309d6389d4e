"""``policies.compile.persistent_rows`` (omnispec/kernels/inductor_rows.py, compile.py): the
bound rides with its own compile, keys inductor's caches, decides inductor's persistence there and nowhere else,
and the spec takes the options only where they mean something."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy
import torch
import torch._inductor.config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.dependencies import MemoryDep
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from benchmarks.gpu_adaln_norm import DoubleNorm2, SingleNorm
from omnispec.kernels.inductor_rows import PersistentRows, RowChoices
from omnispec.policies.compile import _torch_compile_options
from omnispec.spec import SpecError
from omnispec.spec.policies import CompilePolicy


def _features(columns: int, hint: ReductionHint = ReductionHint.INNER, reads: tuple = ()) -> SimpleNamespace:
    node = SimpleNamespace(read_writes=SimpleNamespace(reads=list(reads), writes=[]))
    return SimpleNamespace(reduction_numel=sympy.Integer(columns), numel=sympy.Integer(4608),
                           get_reduction_hint=lambda: hint, scheduler_nodes=lambda: [node])


ROW, COLUMN = sympy.symbols("c0 c1")


def _read(index: sympy.Expr) -> MemoryDep:
    """A read of a 256 x 3,072 buffer at ``index`` of (row, column)."""
    return MemoryDep("buf", index, (ROW, COLUMN), (256, 3072))


@pytest.fixture
def lowering():
    """The part of a graph under lowering that inductor's persistence rule reads: sizes known statically."""
    sizes = SimpleNamespace(statically_known_leq=lambda a, b: a <= b, optimization_hint=lambda n: n)
    with V.set_graph_handler(SimpleNamespace(sizevars=sizes)):
        yield


class _Installed(CustomGraphPass):
    """A post-grad post-pass a process installed before omnispec compiles."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        return "installed"


def test_the_bound_decides_persistence_only_inside_a_compile_that_carries_it(lowering):
    rule = RowChoices().should_use_persistent_reduction
    assert rule(_features(1024), False) and not rule(_features(3072), False)  # inductor's own rule: up to 1,024
    with inductor_config.patch(post_grad_custom_post_pass=PersistentRows(4096)):
        assert rule(_features(3072), False) and rule(_features(4096), False)
        assert not rule(_features(8192), False)
        assert not rule(_features(3072), True), "a cooperative reduction stays inductor's to decide"
        assert not rule(_features(3072, ReductionHint.OUTER), False)
        # DEFAULT: a row of FLUX's modulation table read by index inside the reduction; along rows, it counts
        table = _read(COLUMN + 18432 * sympy.Symbol("tmp0") + 6144)
        assert rule(_features(3072, ReductionHint.DEFAULT, (_read(3072 * ROW + COLUMN), table)), False)
        assert not rule(_features(3072, ReductionHint.DEFAULT, (_read(ROW + 256 * COLUMN),)), False)  # down columns
        with inductor_config.patch({"triton.persistent_reductions": False}):
            assert not rule(_features(3072), False)
    with inductor_config.patch(post_grad_custom_post_pass=_Installed()):  # someone else's compile
        assert not rule(_features(3072), False)


def test_the_options_carry_the_bound_and_key_the_cache_by_it():
    plain = _torch_compile_options(CompilePolicy(mode="regional", persistent_rows=1024))  # inductor's own rule
    assert "post_grad_custom_post_pass" not in plain and "coordinate_descent_tuning" not in plain
    default = _torch_compile_options(CompilePolicy(mode="regional"))["post_grad_custom_post_pass"]
    assert isinstance(default, PersistentRows) and default.persistent_rows == 4096  # the default under inductor
    for elsewhere in (CompilePolicy(), CompilePolicy(mode="regional", backend="aot_eager")):
        assert elsewhere.rows_read_once is None
    rows = _torch_compile_options(CompilePolicy(mode="regional", persistent_rows=4096))["post_grad_custom_post_pass"]
    assert isinstance(rows, PersistentRows) and rows.persistent_rows == 4096 and rows.then == ()
    assert rows.uuid() != PersistentRows(8192).uuid()  # a graph compiled under one bound is not served to another
    installed = _Installed()
    with inductor_config.patch(post_grad_custom_post_pass=installed):
        chained = _torch_compile_options(CompilePolicy(mode="regional", persistent_rows=4096))
    chained = chained["post_grad_custom_post_pass"]
    assert chained.then == (installed,) and chained.uuid()[-1] == "installed"
    graph = torch.fx.Graph()
    chained(graph)
    assert installed.calls == 1


def test_a_compile_with_the_bound_puts_the_rule_on_its_thread_and_computes_as_before():
    """On the CPU inductor writes C++ (the rule is never asked), so the output equals the compile without it; the
    pass still runs in the compile and leaves ``RowChoices`` on the thread, deciding as inductor does elsewhere."""
    x = torch.randn(6, 3072, dtype=torch.bfloat16) * 3
    scale = torch.randn(3072, dtype=torch.bfloat16) * 0.3

    def modulated_norm(x, scale):
        return torch.nn.functional.layer_norm(x, (3072,), eps=1e-6) * (1 + scale)

    with V.set_choices_handler(InductorChoices()):
        torch._dynamo.reset()
        options = {**_torch_compile_options(CompilePolicy(mode="regional", persistent_rows=4096)),
                   "fx_graph_cache": False}
        got = torch.compile(modulated_norm, fullgraph=True, options=options)(x, scale)
        assert isinstance(V.choices, RowChoices)
    torch._dynamo.reset()
    options = {**_torch_compile_options(CompilePolicy(mode="regional", persistent_rows=1024)), "fx_graph_cache": False}
    assert torch.equal(got, torch.compile(modulated_norm, fullgraph=True, options=options)(x, scale))


def test_the_spec_takes_the_options_for_inductors_compiles_only():
    for bad, message in [({"persistent_rows": 4096}, "apply to compiled code"),
                         ({"mode": "regional", "backend": "aot_eager", "persistent_rows": 4096}, "inductor's"),
                         ({"mode": "regional", "persistent_rows": 512}, "greater than or equal to 1024"),
                         ({"mode": "regional", "persistent_rows": 65536}, "less than or equal to 16384")]:
        with pytest.raises(ValueError, match=message):
            CompilePolicy(**bad)


def test_a_process_with_heuristics_of_its_own_is_refused_at_build():
    """(Inductor's ``config.patch``, not pytest's monkeypatch: undoing a config key, monkeypatch deletes it from
    inductor's config for the rest of the process.)"""
    from omnispec.policies import compile as compile_policy

    spec = SimpleNamespace(policies=SimpleNamespace(compile=CompilePolicy(mode="regional", persistent_rows=4096)),
                           model=SimpleNamespace(components={}))
    with (inductor_config.patch(inductor_choices_class=lambda: InductorChoices()),
          pytest.raises(SpecError, match="inductor_choices_class is set") as refused):
        compile_policy.apply_compile(spec, None, {})
    assert refused.value.problems[0].path == "policies.compile.persistent_rows"


def test_the_default_bound_steps_aside_for_heuristics_of_the_process():
    """Asked for, the bound is refused where someone installed heuristics (above); by default it gives way, and
    explain says inductor's own rule wrote the norms."""
    from omnispec.policies import compile as compile_policy

    spec = SimpleNamespace(policies=SimpleNamespace(compile=CompilePolicy(mode="regional")),
                           model=SimpleNamespace(components={}))
    with inductor_config.patch(inductor_choices_class=lambda: InductorChoices()):
        assert "inductor's own norm kernels" in compile_policy.apply_compile(spec, None, {})
    assert "norms read once up to 4096 elements" in compile_policy.apply_compile(spec, None, {})


@pytest.mark.gpu
@pytest.mark.parametrize("place", ["single block", "double block"])
def test_on_cuda_flux_norms_read_their_rows_once_and_each_row_alone(place):
    """FLUX's single-block start (the streams joined, normed, modulated) and a double block's second norm (the
    attention output gated by the modulation table's row, read by index, which makes inductor call the reduction
    DEFAULT), as gpu_adaln_norm times them: inductor's own rule writes them as looped reductions, the bound as
    persistent ones; the output stays within bf16's rounding of eager's, and a row computed alone equals the row in
    a batch (what an exact replay with other micro-batches needs)."""
    import re

    from torch._inductor.utils import run_and_get_code

    def kernels(fn, policy: CompilePolicy, *args) -> tuple[list[str], tuple]:
        torch._dynamo.reset()
        options = {**_torch_compile_options(policy), "fx_graph_cache": False}
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False, options=options), *args)
        return re.findall(r"def (triton_(?:red|per)_\w*layer_norm\w*)\(", "\n".join(code)), out

    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    rows = torch.tensor([3, 5], device="cuda")
    if place == "single block":
        fn = SingleNorm().cuda()
        args = (torch.randn(2, 64, 3072, **bf16) * 3, torch.randn(2, 448, 3072, **bf16) * 3,
                torch.randn(8, 3 * 3072, **bf16) * 0.3, rows)
        alone_args = (args[0][1:], args[1][1:], args[2], rows[1:])
    else:
        fn = DoubleNorm2().cuda()
        args = (torch.randn(2, 512, 3072, **bf16) * 3, torch.randn(2, 512, 3072, **bf16) * 3,
                torch.randn(8, 6 * 3072, **bf16) * 0.3, rows)
        alone_args = (args[0][1:], args[1][1:], args[2], rows[1:])
    looped, _ = kernels(fn, CompilePolicy(mode="regional", persistent_rows=1024), *args)
    assert looped and all(name.startswith("triton_red_") for name in looped), looped
    persistent, (normed, *_) = kernels(fn, CompilePolicy(mode="regional"), *args)  # the default: 4,096
    assert persistent and all(name.startswith("triton_per_") for name in persistent), persistent
    want, *_ = fn(*args)
    assert (normed.float() - want.float()).abs().max() <= 2 ** -4 * want.float().abs().max()
    _, (alone, *_) = kernels(fn, CompilePolicy(mode="regional", persistent_rows=4096), *alone_args)
    assert torch.equal(alone, normed[1:])
