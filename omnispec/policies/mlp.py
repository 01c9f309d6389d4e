"""``policies.mlp.fused_gelu``: the fused feed-forward matmuls (``kernels.gemm_epilogue``) put in place of the
denoisers' tanh-GELU projections, and hooked into a family's parallel blocks (its ``MlpTarget``: FLUX's single
blocks project their attention and MLP outputs back without concatenating them).

Which modules: every diffusers ``GELU`` with the tanh approximation (the feed-forwards of FLUX, SD3, Wan, LTX-2,
Qwen-Image). A module whose weights are not plain tensors on the input's device (a LoRA, fp8 or sharded weights, an
offloaded layer) runs its own forward. What it gives: BENCHMARKS.md, "Fused GELU: cuBLASLt epilogues".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from diffusers.hooks import HookRegistry
from diffusers.models.activations import GELU

from ..bridge import remove_hook
from ..kernels.gemm_epilogue import OPERATORS, linear_gelu, plain_linear
from ..spec import PipelineSpec, SpecError
from ..targets import Targets

HOOK_NAME = "omnispec_fused_gelu"


class FusedGelu(torch.nn.Module):
    """A diffusers ``GELU`` (tanh) module's projection and GELU as ``linear_gelu``, in its place: the same ``proj``
    (so its weights keep their names), its own arithmetic where the projection's weights are not plain
    (``plain_linear``: a LoRA, quantized weights). A module put in place rather than a hook on the ``GELU``: dynamo
    guards a hooked module's forward by identity, and a regionally compiled block would recompile for each block."""

    def __init__(self, replaced: GELU):
        super().__init__()
        self.proj = replaced.proj
        self.__dict__["replaced"] = replaced  # not a submodule: its weights are ``proj``'s

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not plain_linear(self.proj, hidden_states):
            return self.replaced.gelu(self.proj(hidden_states))
        return linear_gelu(hidden_states, self.proj.weight, self.proj.bias)

    def restored(self) -> GELU:
        """The ``GELU`` it replaced, with the projection it holds now (a LoRA may have wrapped it since)."""
        self.replaced.proj = self.proj
        return self.replaced


def fuse_gelus(model: torch.nn.Module) -> int:
    """Put ``FusedGelu`` in place of ``model``'s tanh-GELU projections; returns how many."""
    return _swap_children(model, lambda m: FusedGelu(m) if isinstance(m, GELU) and m.approximate == "tanh"
                          and type(m.proj) is torch.nn.Linear else None)


def unfuse_gelus(model: torch.nn.Module) -> None:
    """Undo ``fused_gelu`` on ``model``: each ``GELU`` back in place, the parallel blocks' hooks removed."""
    for module in model.modules():
        remove_hook(module, HOOK_NAME)
    _swap_children(model, lambda m: m.restored() if isinstance(m, FusedGelu) else None)


def _swap_children(model: torch.nn.Module, swap: Callable[[torch.nn.Module], torch.nn.Module | None]) -> int:
    """Replace each submodule for which ``swap`` returns a module; returns how many were replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (replacement := swap(child)) is not None:
                setattr(parent, name, replacement)
                swapped += 1
    return swapped


def apply_mlp(spec: PipelineSpec, targets: Targets, denoisers: Mapping[str, torch.nn.Module]) -> str | None:
    """Put ``FusedGelu`` in place of the denoisers' tanh-GELU projections and hook the family's parallel blocks
    (``fused_gelu``); a rebuild over the same modules first undoes what an earlier build did. Returns explain's note
    (None: nothing fused)."""
    fused = spec.policies.mlp.fused_gelu
    notes = []
    for name, denoiser in denoisers.items():
        unfuse_gelus(denoiser)
        if not fused:
            continue
        gelus = fuse_gelus(denoiser)
        hooks = targets.mlp.parallel_hooks if targets.mlp is not None else None
        blocks = hooks(denoiser, OPERATORS) if hooks is not None else []
        for module, hook in blocks:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        # tanh-GELUs left as they were: their projection is another layer class (quantized at load, a LoRA), whose
        # own matmul runs (the fused operators take plain weights only)
        kept = sum(1 for m in denoiser.modules() if isinstance(m, GELU) and m.approximate == "tanh")
        if not gelus and not blocks:
            if kept:
                notes.append(f"{name}: nothing fused: its {kept} tanh-GELU projections are quantized or wrapped "
                             "layers, which run their own matmuls")
                continue
            raise SpecError.single(f"{targets.missing('mlp')}: {name} gates its feed-forwards or uses another "
                                   "activation", "policies.mlp.fused_gelu")
        notes.append(f"{name}: bias + GELU in the matmul for {gelus} feed-forward projections"
                     + (f", {len(blocks)} parallel blocks projected without concatenating" if blocks else "")
                     + (f"; {kept} quantized or wrapped projections run their own matmuls" if kept else ""))
    if not fused:
        return None
    return "; ".join(notes) + " (CUDA; the model's own operations elsewhere)"
