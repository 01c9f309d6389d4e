"""The one bridge to torch's internals: every private torch name omnispec uses is read here, and nowhere else.

Each is a pin on the torch minor series it was checked against (``CHECKED_AGAINST``: the CPU build CI runs and the
GPU machines' build), listed in ``PRIVATE`` with why omnispec reads it instead of a public API.
``tests/test_torch_internals.py`` fails when an installed torch lacks one, and when a private torch name appears
anywhere else in omnispec. Names resolve on first use (``__getattr__``), so importing this module imports no compiler
machinery: a module that needs one imports it from here when it is itself imported (the kernels' compile passes,
only when a spec compiles).
"""

from __future__ import annotations

import importlib
from typing import Any

CHECKED_AGAINST = ("2.11", "2.13")

# (the name this module gives it, module, name, why) -- every private torch name omnispec reads, checked against
# each of CHECKED_AGAINST.
PRIVATE: tuple[tuple[str, str, str, str], ...] = (
    ("inductor_config", "torch._inductor", "config",
     "inductor's options (the post-grad pass slots a compile's passes chain to, the choices class persistent rows "
     "installs, the reduction heuristics); torch.compile's options= sets only some"),
    ("list_mode_options", "torch._inductor", "list_mode_options",
     "the options a torch.compile mode stands for: torch.compile takes a mode or options, not both, so a mode goes "
     "in as its options beside omnispec's own"),
    ("InductorChoices", "torch._inductor.choices", "InductorChoices",
     "the base of the heuristics that let a norm read its row once (persistent reductions past inductor's 1,024 "
     "elements); inductor has no public hook for them"),
    ("CustomGraphPass", "torch._inductor.custom_graph_pass", "CustomGraphPass",
     "the base of a post-grad graph pass whose hash keys inductor's caches (the documented form of a custom pass, "
     "under a private module)"),
    ("get_hash_for_files", "torch._inductor.custom_graph_pass", "get_hash_for_files",
     "a pass's cache key from its source files"),
    ("MemoryDep", "torch._inductor.dependencies", "MemoryDep",
     "what a reduction reads, for the persistent-rows heuristic"),
    ("ReductionHint", "torch._inductor.runtime.hints", "ReductionHint",
     "the reduction kinds the persistent-rows heuristic tells apart"),
    ("V", "torch._inductor.virtualized", "V",
     "the graph being lowered, which the persistent-rows heuristic reads"),
    ("force_stride_order", "torch._inductor.inductor_prims", "force_stride_order",
     "importing the module registers the prim the quantized-input pass inserts (prims.inductor_force_stride_order)"),
    ("get_manager", "torch._inductor.cudagraph_trees", "get_manager",
     "whether a compiled forward with gradients still waits for its backward, before a new CUDA-graph generation "
     "would hand its memory to the next replay; no public reading"),
    ("dynamo_config", "torch._dynamo", "config",
     "dynamo's per-code recompile limit, raised for the block variants regional compile meets (grad mode, LoRA- "
     "wrapped or quantized weights)"),
    ("mark_static_address", "torch._dynamo", "mark_static_address",
     "the shared block inputs kept in static storage under regional CUDA graphs (torch.compiler has no public form "
     "in the checked versions)"),
    ("_addmm_activation", "torch", "_addmm_activation",
     "cuBLASLt's bias + tanh-GELU epilogue in one matmul; no public operator"),
    ("TorchDispatchMode", "torch.utils._python_dispatch", "TorchDispatchMode",
     "the estimate counts a forward's ops on the meta device below autograd (the documented extension point, under "
     "a private module)"),
    ("tree_flatten", "torch.utils._pytree", "tree_flatten",
     "nested outputs and arguments, flattened (no public pytree module)"),
    ("tree_unflatten", "torch.utils._pytree", "tree_unflatten",
     "the inverse"),
    ("tree_map", "torch.utils._pytree", "tree_map",
     "a function over nested tensors"),
    ("tree_map_only", "torch.utils._pytree", "tree_map_only",
     "a function over the tensors of a nested output"),
    ("_scaled_dot_product_flash_attention_for_cpu", "torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu",
     "the CPU flash kernel, returning the log-sum-exp ring attention merges steps with: registered under the CUDA "
     "op's name so ring attention runs on gloo"),
    # exact attention's gradients inside a backward operator's body (kernels/sdpa.exact_attention_gradients), where
    # autograd records nothing and torch.func's wrappers fail under a TorchDispatchMode: SDPA's own forward and
    # backward kernels, called as autograd would call them
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "torch.ops.aten",
     "_scaled_dot_product_flash_attention_for_cpu_backward", "the CPU flash kernel's backward"),
    ("_scaled_dot_product_flash_attention", "torch.ops.aten", "_scaled_dot_product_flash_attention",
     "CUDA flash attention's forward with the log-sum-exp and the state its backward takes"),
    ("_scaled_dot_product_flash_attention_backward", "torch.ops.aten", "_scaled_dot_product_flash_attention_backward",
     "CUDA flash attention's backward"),
    ("_scaled_dot_product_efficient_attention", "torch.ops.aten", "_scaled_dot_product_efficient_attention",
     "CUDA memory-efficient attention's forward with the log-sum-exp and the state its backward takes"),
    ("_scaled_dot_product_efficient_attention_backward", "torch.ops.aten",
     "_scaled_dot_product_efficient_attention_backward", "CUDA memory-efficient attention's backward"),
)

_WHERE = {export: (module, name) for export, module, name, _ in PRIVATE}


def resolve(module: str, name: str) -> Any:
    """``module.name`` (``torch.ops.aten`` names through the op namespace)."""
    return getattr(importlib.import_module(module) if module != "torch.ops.aten" else _aten(), name)


def _aten() -> Any:
    import torch

    return torch.ops.aten


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"{__name__} has no {name!r}: list a private torch name in PRIVATE first")
    return resolve(*_WHERE[name])


__all__ = ["CHECKED_AGAINST", "PRIVATE", "resolve"]
