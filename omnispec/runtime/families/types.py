"""The data a family adapter exchanges with the runtime: latent streams, conditioning, geometry, decoded outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from ...spec import Modality, SkipLayer

# The state a phase denoises: named latent streams (``latents`` for image and video models; ``video`` and
# ``audio`` for LTX-2), each with its own shape and packing, batch first.
Streams = dict[str, torch.Tensor]


def cat_streams(parts: Sequence[Mapping[str, torch.Tensor]]) -> Streams:
    return {name: torch.cat([p[name] for p in parts]) if len(parts) > 1 else parts[0][name] for name in parts[0]}


def batch_of(streams: Mapping[str, torch.Tensor]) -> int:
    return next(iter(streams.values())).shape[0]


@dataclass
class Conditioning:
    """What a pass conditions on besides the latents: encoded prompts and, for image-conditioned families,
    the encoded images. ``batched`` tensors have one row per sample; ``shared`` ones serve every sample.
    ``ragged`` names batched entries whose length (dim 1) may differ between conditionings (prompt encodings
    padded to their own call's longest prompt): ``cat`` zero-pads them to the longest, so their masks, listed
    too, mark the padding 0."""

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    ragged: frozenset[str] = frozenset()

    @property
    def batch_size(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def rows(self, index: torch.Tensor | slice | Sequence[int]) -> Conditioning:
        """These rows of every batched entry (an entry may live on the host, e.g. lengths a family reads every
        step without a device sync: a tensor index goes to each entry's own device)."""
        if isinstance(index, torch.Tensor):
            return Conditioning({k: v[index.to(v.device)] for k, v in self.batched.items()}, self.shared, self.ragged)
        return Conditioning({k: v[index] for k, v in self.batched.items()}, self.shared, self.ragged)

    def with_(self, other: Conditioning | None) -> Conditioning:
        """This conditioning plus ``other``'s entries (image conditioning joined to prompt encodings)."""
        if other is None:
            return self
        return Conditioning({**self.batched, **other.batched}, {**self.shared, **other.shared},
                            self.ragged | other.ragged)

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        if len(parts) == 1:
            return parts[0]
        ragged = parts[0].ragged
        return Conditioning({k: torch.cat(_padded([p.batched[k] for p in parts]) if k in ragged else
                                          [p.batched[k] for p in parts]) for k in parts[0].batched},
                            parts[0].shared, ragged)


def _padded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero-pad each tensor's dim 1 to the longest's."""
    n = max(t.shape[1] for t in tensors)
    return [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, n - t.shape[1])) for t in tensors]


@dataclass
class Geometry:
    """Pixel size of a phase's output and anything a family needs to (un)pack its latents; ``extra`` holds
    what a family derives once per phase (position ids, masks) so steps don't rebuild it."""

    height: int
    width: int
    frames: int | None = None
    fps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decoded:
    """A decoded output: ``array`` float32 in [0, 1], channels last, batch first; ``audio`` (B, channels,
    samples) float32 at ``sample_rate`` for families with a sound track."""

    array: np.ndarray
    audio: np.ndarray | None = None
    sample_rate: int | None = None


Perturbation = Union[SkipLayer, Modality]
