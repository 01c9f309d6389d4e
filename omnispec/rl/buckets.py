"""Weights sent in buckets: a state dict cut into pieces of at most ``bucket_bytes`` bytes each (a tensor larger
than the room left in a bucket is split across buckets), and put back together on the other side.

A bucket is a list of ``Piece``s: a slice of one tensor's flattened elements, with the tensor's name, shape and
dtype, so the receiver needs nothing but the pieces, in any bucket order. A piece holds its elements' bytes as a
numpy ``uint8`` array: Ray serializes those out of band, without a pickled copy, and a worker reads them straight
from the object store's shared memory (read-only), copying each once into the tensor it rebuilds. ``Assembler``
collects pieces and hands out each tensor once all its elements arrived; ``incomplete`` names the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..spec import SpecError, SpecTypeError


@dataclass
class Piece:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # the first flattened element this piece holds
    data: np.ndarray  # the bytes of its elements, uint8, 1-D

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


def check_bucket_bytes(bucket_bytes: object) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise SpecTypeError.single(f"expected an int (bytes), got {type(bucket_bytes).__name__}", "bucket_bytes")
    if bucket_bytes < 16:
        raise SpecError.single(f"a bucket must hold at least 16 bytes, got {bucket_bytes}", "bucket_bytes")
    return bucket_bytes


def to_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[Piece]]:
    """Buckets of pieces, each at most ``bucket_bytes`` bytes (a single element larger than that is a bucket of
    its own), in the order of ``named``. A device tensor is copied to the host once; the pieces of a contiguous host
tensor view its memory (no copy), so a bucket is to be sent (``ray.put``, pickled) before that tensor changes."""
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    bucket: list[Piece] = []
    room = bucket_bytes
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        size, start = flat.element_size(), 0
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
        if flat.numel() == 0:
            bucket.append(Piece(name, tuple(tensor.shape), tensor.dtype, 0, raw))
            continue
        while start < flat.numel():
            take = min(flat.numel() - start, room // size)
            if take == 0:
                if bucket:  # no room left for one element: close this bucket
                    yield bucket
                    bucket, room = [], bucket_bytes
                    continue
                take = 1  # an element larger than a whole bucket
            # a view: Ray (and pickle) serialize only the viewed bytes of a contiguous numpy slice
            bucket.append(Piece(name, tuple(tensor.shape), tensor.dtype, start, raw[start * size:(start + take) * size]))
            start += take
            room -= take * size
    if bucket:
        yield bucket


class Assembler:
    """Tensors put back together from pieces; ``add`` returns the tensors a bucket completed."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (flat buffer, elements still missing)
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def add(self, bucket: Iterable[Piece]) -> dict[str, torch.Tensor]:
        done = {}
        for piece in bucket:
            if not isinstance(piece, Piece):
                raise SpecTypeError.single(f"expected a Piece, got {type(piece).__name__}", "bucket")
            numel = 1
            for d in piece.shape:
                numel *= d
            if piece.name not in self._parts:
                self._parts[piece.name] = (torch.empty(numel, dtype=piece.dtype), numel)
                self._shapes[piece.name] = (piece.shape, piece.dtype)
            elif self._shapes[piece.name] != (piece.shape, piece.dtype):
                raise SpecError.single(f"{piece.name}: pieces of different shapes or dtypes", "bucket")
            flat, missing = self._parts[piece.name]
            data = piece.data
            if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1
                    and data.nbytes % piece.dtype.itemsize == 0):
                raise SpecError.single(f"{piece.name}: a piece's data is not whole elements' bytes", "bucket")
            end = piece.start + piece.numel
            if piece.start < 0 or end > numel:
                raise SpecError.single(f"{piece.name}: a piece [{piece.start}, {end}) outside its {numel} elements",
                                       "bucket")
            if piece.numel:
                with warnings.catch_warnings():  # read-only shared memory: read once, never written
                    warnings.filterwarnings("ignore", message=".*not writable.*")
                    source = torch.from_numpy(data)
                flat[piece.start:end].view(torch.uint8).copy_(source)
            missing -= piece.numel
            self._parts[piece.name] = (flat, missing)
            if missing == 0:
                done[piece.name] = flat.view(piece.shape)
                del self._parts[piece.name], self._shapes[piece.name]
        return done

    def incomplete(self) -> list[str]:
        return sorted(self._parts)

    def clear(self) -> None:
        self._parts.clear()
        self._shapes.clear()


def state_items(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a state dict or pairs, each a tensor, names unique."""
    pairs = list(state.items()) if isinstance(state, Mapping) else list(state)
    seen: set[str] = set()
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise SpecTypeError.single("expected (name, tensor) pairs or a mapping of name to tensor", f"state.{i}")
        if pair[0] in seen:
            raise SpecError.single(f"{pair[0]!r} given twice", f"state.{i}")
        seen.add(pair[0])
    return [(n, t) for n, t in pairs]
