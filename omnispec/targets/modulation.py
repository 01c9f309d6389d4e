"""``policies.mlp.precomputed_modulation``'s target: the embedding every modulation linear reads, and those linears."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModulationTarget:
    """``embedder``: the denoiser's module whose output every modulation linear reads (through a SiLU). ``linears``:
    fnmatch patterns of those linears' names. ``embeddings``: bound by the family instance
    (its ``modulation_embeddings``), ``(denoiser, timesteps, embedded, cond) -> embedder outputs`` for every (step, row)
    pair, step-major, as its forwards compute them one step at a time."""

    embedder: str
    linears: tuple[str, ...]
    embeddings: Callable[..., Any] | None = None

    def named_linears(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The modules of ``named`` (a denoiser's ``named_modules()``) that ``linears`` names."""
        return [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in self.linears)]

    def leaves(self) -> list[str]:
        """The last name of each pattern (``norm1.linear``'s ``linear``), for a quantization ``exclude``."""
        return list(dict.fromkeys(p.rsplit("*.", 1)[-1] for p in self.linears))
