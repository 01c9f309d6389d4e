"""Modulation linears computed once per request (``policies.mlp.precomputed_modulation``).

An AdaLN denoiser's blocks each project the timestep-and-prompt embedding into their shifts, scales and gates
(``linear(silu(temb))``). At a step's batch of a few rows that is a matrix-vector product reading the whole weight,
every step (BENCHMARKS.md, "Modulation table", has what it costs FLUX.1-dev). The embedding depends only on the
step's timestep, the embedded
guidance and the pooled prompt, all known before the first step, so every step's rows can be projected in one matmul
per linear, each weight read once.

``ModulationTables`` holds what a denoiser gets: a hook on the embedder (the modulation target's ``embedder``),
which finds for each row of a forward's embedding the nearest row of the table's embeddings (every step of the
phase, every row of its conditionings), and each modulation linear (the target's ``linears``) made a ``TabledLinear``,
which then returns its table rows instead of computing. The nearest row, not a step index, so that no forward needs
to be told which step or which of the request's rows it runs: the table holds them all, and the match is exact up to
the rounding between a step's embedding computed alone and in the table's batch (the steps of a schedule lie far
apart in it: its timestep embedding is sinusoidal, with frequencies up to one radian per timestep unit). A table's
first forward outside compiled code checks that every row lies within ``TABLE_TOLERANCE`` of its match, and raises
otherwise: a family whose ``modulation_embeddings`` missed a case its forwards compute fails there instead of
modulating with another step's values. ``Run`` keeps a phase's table from its first prediction and installs it
around each prediction only: outside one (a warm-up, a benchmark calling the denoiser), and for a linear whose
weights are not plain (a LoRA's base is: the table is the base's output and the LoRA adds to it; a quantized or
sharded linear is not), the model computes as it does.

Rollout and replay build the same table (every step of the phase, every row of the request, in the same order): a
replay with other micro-batches reads the very values its rollout read. Without gradients a phase's table is built
once and kept; in a forward with gradients where the embedder's or a linear's weights take them (a trainer training
them), each prediction builds its own table with gradients, from the same matmuls, so it holds the kept table's
values and its backward reaches those weights (a kept one would be freed by the first backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from ..bridge import remove_hook
from ..kernels.gemm_epilogue import plain_weights
from ..spec import PipelineSpec, SpecError
from ..targets import ModulationTarget
from .steps import StepPolicy

FIELD = "policies.mlp.precomputed_modulation"
EMBEDDER_HOOK = "omnispec_modulation_rows"


class _TableRows(ModelHook):
    """On the embedder: each forward's rows' places in the installed table (None without one)."""

    def __init__(self, tables: ModulationTables):
        super().__init__()
        self.tables = tables

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        tables, table = self.tables, self.tables.table
        tables.rows = None if table is None else nearest_rows(output, table.embeddings)
        if table is not None and not table.checked and not torch.compiler.is_compiling():
            check_rows(output, table.embeddings, tables.rows)
            table.checked = True
        return output


class TabledLinear(torch.nn.Linear):
    """A modulation linear under the policy: its table's rows for this forward, or ``nn.Linear``'s product without
    a table. Swapped in by class, not hooked: the module keeps its place, names, parameters and whatever wraps it
    (a LoRA layer's base), and a hook's per-module ``forward`` would make dynamo guard on each block's own function
    and compile every block of a regional compile anew."""

    modulation: ModulationTables
    modulation_outputs: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, outputs = self.modulation.rows, self.modulation_outputs
        if outputs is None or rows is None or x.dim() != 2 or x.shape[0] != rows.shape[0]:
            return super().forward(x)
        return outputs.index_select(0, rows)


def distinct_rows(embeddings: torch.Tensor) -> torch.Tensor:
    """``embeddings`` without repeated rows (each kept at its first place): a group of samples of one prompt, or a
    family whose embedding reads no prompt (Qwen-Image's), gives every step one row, not one per sample and pass."""
    _, inverse = torch.unique(embeddings.detach().float(), dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=inverse.device, dtype=inverse.dtype)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
    return embeddings[first.sort().values]


def nearest_rows(embedding: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """For each row of ``embedding``, the index of ``table``'s row nearest to it (squared distance, in float32)."""
    e, t = embedding.float(), table.float()
    return ((t * t).sum(-1) - 2 * e @ t.T).argmin(-1)


# How far (squared, relative to the embedding's own squared norm) a forward's embedding may lie from its table row.
# On the tiny FLUX in bfloat16 a row computed alone equals its batched twin, and neighbouring steps of a 28-step
# schedule lie 0.12 apart; steps whose timesteps round to one bfloat16 value (a 400-step schedule's, near 1,000) have
# equal rows, and so equal outputs, whichever is matched.
TABLE_TOLERANCE = 1e-3


def check_rows(embedding: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> None:
    """Refuse a forward whose embedding is not in the table (a family's ``modulation_embeddings`` that misses a case
    its forwards compute): checked on a table's first forward, once (it reads the distances on the host)."""
    e = embedding.float()
    off = ((e - table.float()[rows]) ** 2).sum(-1) / (e * e).sum(-1).clamp_min(1e-30)
    if (worst := off.max().item()) > TABLE_TOLERANCE:
        raise RuntimeError(f"{FIELD}: a forward's timestep embedding is not in the modulation table (relative "
                           f"squared distance {worst:.2e} to the nearest row, tolerance {TABLE_TOLERANCE:.0e}): the "
                           "family's modulation_embeddings does not cover what its forwards compute; set "
                           f"{FIELD}=false")


@dataclass
class _Table:
    embeddings: torch.Tensor
    outputs: list[torch.Tensor | None]  # per hooked linear, None where it computes
    checked: bool = False  # whether a first eager forward found its rows in it


class ModulationTables:
    """A denoiser's modulation hooks and the table installed now (``table``; None: none)."""

    def __init__(self, embedder: torch.nn.Module, linears: Sequence[torch.nn.Linear]):
        self.embedder = embedder
        self.rows: torch.Tensor | None = None
        self.table: _Table | None = None
        # Kept tables' storage by row count (the two sizes used last), with the table whose values it holds now.
        self.storage: dict[int, _Table] = {}
        HookRegistry.check_if_exists_or_initialize(embedder).register_hook(_TableRows(self), EMBEDDER_HOOK)
        self.linears: list[TabledLinear] = []
        for linear in linears:
            linear.__class__ = TabledLinear
            linear.modulation, linear.modulation_outputs = self, None
            self.linears.append(linear)  # type: ignore[arg-type]

    def takes_gradients(self) -> bool:
        """Whether a forward now would take gradients into the embedder's or the modulation linears' weights."""
        if not torch.is_grad_enabled():
            return False
        linears = [p for linear in self.linears for p in linear.parameters(recurse=False)]
        return any(p.requires_grad for p in [*self.embedder.parameters(), *linears])

    def build(self, embeddings: torch.Tensor) -> _Table:
        """Every hooked linear's output for every row of ``embeddings`` (the embedder's, as the model's SiLU feeds
        it to the linears), one matmul each; None for a linear whose weights are not plain tensors on the
        embeddings' device."""
        outputs: list[torch.Tensor | None] = []
        for linear in self.linears:
            weight = linear.weight
            if not plain_weights(linear, weight) or weight.device != embeddings.device:
                outputs.append(None)
                continue
            outputs.append(F.linear(F.silu(embeddings).to(weight.dtype), weight, linear.bias))
        return _Table(embeddings, outputs)

    def for_phase(self, embeddings: Callable[..., torch.Tensor], walk: Any, run: Any,
                  kept: dict[int, _Table]) -> _Table:
        """Phase ``run``'s table: the one in ``kept`` (by id of ``run``) while the storage still holds it, else
        built (``phase_table``) into the storage and kept; in a forward taking gradients into these weights, built
        afresh with them."""
        if self.takes_gradients():
            return phase_table(embeddings, self, walk, run)
        table = kept.get(id(run))
        if table is None or self.storage.get(table.embeddings.shape[0]) is not table:
            with torch.no_grad():
                table = kept[id(run)] = self._stored(phase_table(embeddings, self, walk, run))
        return table

    def _stored(self, table: _Table) -> _Table:
        """``table``'s values in the storage of its size, which a table of that size built earlier leaves behind:
        compiled blocks under CUDA graphs take a module's tensors as static inputs, so a table in new memory at
        each request would have every block's graph recorded again."""
        size = table.embeddings.shape[0]
        held = self.storage.pop(size, None)
        if held is not None and _same_layout(held, table):
            held.embeddings.copy_(table.embeddings)
            for into, values in zip(held.outputs, table.outputs, strict=True):
                if into is not None:
                    into.copy_(values)
            table = _Table(held.embeddings, held.outputs)
        self.storage[size] = table
        while len(self.storage) > 2:
            del self.storage[next(iter(self.storage))]
        return table

    @contextlib.contextmanager
    def installed(self, table: _Table) -> Iterator[None]:
        self.table = table
        for linear, outputs in zip(self.linears, table.outputs, strict=True):
            linear.modulation_outputs = outputs
        try:
            yield
        finally:
            self.table = self.rows = None
            for linear in self.linears:
                linear.modulation_outputs = None

    def remove(self) -> None:
        """The embedder unhooked and each linear a ``torch.nn.Linear`` again."""
        remove_hook(self.embedder, EMBEDDER_HOOK)
        for linear in self.linears:
            linear.__class__ = torch.nn.Linear
            del linear.modulation, linear.modulation_outputs


def _same_layout(a: _Table, b: _Table) -> bool:
    pairs = [(a.embeddings, b.embeddings), *zip(a.outputs, b.outputs, strict=True)]
    return all((x is None) == (y is None) and (x is None or (x.shape, x.dtype, x.device) == (
        y.shape, y.dtype, y.device)) for x, y in pairs)


def phase_table(embeddings_of: Callable[..., torch.Tensor], tables: ModulationTables, walk: Any, run: Any) -> _Table:
    """The table of phase ``run`` of ``walk`` (a ``plan.PhaseRun``): the embedding of every step the phase computes
    and every row of each conditioning its passes read (each conditioning once, each distinct row once), padded to a
    power of two rows (at least 8) with copies of the first, so that a compiled block sees a handful of table sizes,
    not one per request's step count."""
    steps = [i for i in run.indices if not run.plans[i].zero]
    timesteps = [walk.steps.timesteps[i] for i in steps]
    embedded = [run.plans[i].embedded for i in steps]
    conditions = list({id(c): c for c in run.passes.conditions.values()}.values())
    embeddings = distinct_rows(torch.cat([embeddings_of(run.denoiser, timesteps, embedded, c)
                                          for c in conditions]))
    n = embeddings.shape[0]
    return tables.build(torch.cat([embeddings, embeddings[:1].expand(padded_rows(n) - n, -1)]))


def tables_of(denoiser: torch.nn.Module) -> ModulationTables | None:
    return getattr(denoiser, "_omnispec_modulation", None)


class ModulationStep(StepPolicy):
    """The table installed around each step's forwards: the phase's table (``ModulationTables.for_phase``, kept for
    the request in the run's ``scratch``), built with the embeddings of the run's modulation target."""

    def step_context(self, run: Any, walk: Any, phase_run: Any, step: int) -> AbstractContextManager:
        tables = tables_of(phase_run.denoiser)
        if tables is None or phase_run.passes is None:
            return contextlib.nullcontext()
        kept = run.scratch.setdefault(self, {})
        return tables.installed(tables.for_phase(run.targets.modulation.embeddings, walk, phase_run, kept))


def apply_modulation(spec: PipelineSpec, target: ModulationTarget | None,
                     denoisers: dict[str, torch.nn.Module]) -> str | None:
    """Hook each denoiser's embedder and modulation linears (``precomputed_modulation``); a rebuild over the same
    modules first removes what an earlier build hooked. Returns explain's note (None: off)."""
    on = spec.policies.mlp.precomputed_modulation
    notes = []
    for name, denoiser in denoisers.items():
        if (old := tables_of(denoiser)) is not None:
            old.remove()
            del denoiser._omnispec_modulation
        if not on:
            continue
        assert target is not None, "check_policies refuses precomputed_modulation on a family without the target"
        embedder = dict(denoiser.named_modules()).get(target.embedder)
        named = modulation_linears(target, denoiser, plain_only=False)
        linears = [m for m in named if _table_takes(m)]
        if embedder is None or not named:
            raise SpecError.single(f"{name} has no {target.embedder!r} embedder or no modulation linears "
                                   f"({', '.join(target.linears)}) to precompute", FIELD)
        if not linears:
            raise SpecError.single(
                f"{name}'s modulation linears are all {type(named[0]).__name__} (quantized), which a table cannot "
                f"take: leave them out of policies.quantization (exclude: [{', '.join(target.leaves())}]) or set "
                "this false", FIELD)
        denoiser._omnispec_modulation = ModulationTables(embedder, linears)
        per_row = row_bytes(linears)
        size = f"{per_row / 2**20:.1f} MiB" if per_row >= 2**20 else f"{per_row / 2**10:.1f} KiB"
        notes.append(f"{name}: {len(linears)} modulation linears from a table built once per phase ({size} per "
                     "distinct step and prompt row)")
    return "; ".join(notes) if on else None


def modulation_linears(target: ModulationTarget, denoiser: torch.nn.Module,
                       plain_only: bool = True) -> list[torch.nn.Linear]:
    """``denoiser``'s modules that the target's ``linears`` names: those a table takes (``torch.nn.Linear``s, not a
    quantization's linear classes), or with ``plain_only`` false all of them."""
    return [m for _, m in target.named_linears(denoiser.named_modules()) if not plain_only or _table_takes(m)]


def _table_takes(module: torch.nn.Module) -> bool:
    """Whether a table can stand in for ``module``: a plain (or already tabled) linear, not a quantization's class."""
    return type(module) in (torch.nn.Linear, TabledLinear)


def padded_rows(n: int) -> int:
    """The rows a table of ``n`` distinct embedding rows takes (``phase_table``): a power of two, at least 8."""
    return max(8, 1 << (n - 1).bit_length())


def row_bytes(linears: Sequence[torch.nn.Linear]) -> int:
    """Device bytes a table row over ``linears`` takes: its outputs and its embedding."""
    return (sum(m.out_features * m.weight.element_size() for m in linears)
            + linears[0].in_features * linears[0].weight.element_size())
