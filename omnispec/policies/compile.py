"""Compilation: ``regional`` compiles each denoiser's repeated blocks (diffusers' ``compile_repeated_blocks``,
falling back to the family's block lists), ``full`` the whole denoiser. Compilation happens lazily on the
first call: benchmarks warm up before timing."""

from __future__ import annotations

from typing import Any

from .. import bridge
from ..spec import PipelineSpec, SpecError


def apply_compile(spec: PipelineSpec, family: Any, components: dict[str, Any]) -> str:
    policy = spec.policies.compile
    if policy.mode == "none":
        return "none"
    kwargs = {"fullgraph": policy.fullgraph, "dynamic": policy.dynamic, "backend": policy.backend}
    for name, c in spec.model.components.items():
        if c.role != "denoiser":
            continue
        module = components[name]
        if policy.mode == "full":
            module.compile(**kwargs)
        elif bridge.has_repeated_blocks(module):
            module.compile_repeated_blocks(**kwargs)
        else:
            blocks = [b for lst in family.block_lists if hasattr(module, lst) for b in getattr(module, lst)]
            if not blocks:
                raise SpecError.single(f"{name} has no repeated blocks to compile regionally", "policies.compile.mode")
            for block in blocks:
                block.compile(**kwargs)
    return f"{policy.mode} (backend {policy.backend}, fullgraph {policy.fullgraph}, dynamic {policy.dynamic})"
