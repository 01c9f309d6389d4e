"""The block-level policies' target (compile, offload, shard, layer skip): a denoiser's repeated blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlocksTarget:
    """``lists``: the denoiser's block lists (attribute names of ``ModuleList``s), in forward order; the first is
    what a skip-layer term indexes by default. ``shared_inputs``: modules called once per forward whose outputs every
    block reads (the rotary embedding, the timestep embedding): under regional CUDA graphs they are kept in static
    storage instead of being copied into every block's graph before each replay."""

    lists: tuple[str, ...] = ("transformer_blocks",)
    shared_inputs: tuple[str, ...] = ()

    def blocks(self, denoiser: Any) -> list[Any]:
        """Every block of ``denoiser``'s lists, in forward order (lists it lacks are skipped)."""
        return [b for name in self.lists for b in getattr(denoiser, name, ())]
