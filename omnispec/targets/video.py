"""``policies.attention.sparse``'s target: which attention roles attend over the video's tokens alone, and how a
denoiser call lays those tokens out as a (frames, height, width) grid."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VideoTokensTarget:
    """``roles``: the attention roles whose calls attend from the video's tokens to the video's tokens only (a call
    of those modules over another length, appended keyframe tokens for instance, runs dense). ``grid``:
    ``(denoiser, args, kwargs) -> (frames, height, width)`` of a denoiser call's video tokens, in the order the
    denoiser flattens them (frames outermost, then rows, then columns). ``compiled_refusal``: why sparse attention cannot
    run under compile on this family (compiled, one redirect around the denoiser's call takes every plain attention
    call over exactly the grid's tokens at the roles' head sizes, so another module's such calls, outside ``roles``,
    would turn sparse too), or None."""

    roles: tuple[str, ...]
    grid: Callable[[Any, tuple, Mapping[str, Any]], tuple[int, int, int]]
    compiled_refusal: str | None = None
