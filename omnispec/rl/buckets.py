"""Weights sent in buckets: a state dict cut into pieces of at most ``bucket_bytes`` bytes each (a tensor larger
than the room left in a bucket is split across buckets), and put back together on the other side.

A bucket is a list of ``Piece``s: a slice of one tensor's flattened elements, with the tensor's name, shape and
dtype, so the receiver needs nothing but the pieces, in any bucket order. ``Assembler`` collects pieces and hands
out each tensor once all its elements arrived; ``finish`` says which tensors are still incomplete.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..spec import SpecError, SpecTypeError


@dataclass
class Piece:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # the first flattened element this piece holds
    data: torch.Tensor  # 1-D, contiguous, on the CPU

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def check_bucket_bytes(bucket_bytes: object) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise SpecTypeError.single(f"expected an int (bytes), got {type(bucket_bytes).__name__}", "bucket_bytes")
    if bucket_bytes < 16:
        raise SpecError.single(f"a bucket must hold at least 16 bytes, got {bucket_bytes}", "bucket_bytes")
    return bucket_bytes


def to_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[Piece]]:
    """Buckets of pieces, each at most ``bucket_bytes`` bytes (a single element larger than that is a bucket of
    its own), in the order of ``named``. Tensors are copied to the host once, detached, and kept contiguous."""
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    bucket: list[Piece] = []
    room = bucket_bytes
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        size, start = flat.element_size(), 0
        if flat.numel() == 0:
            bucket.append(Piece(name, tuple(tensor.shape), tensor.dtype, 0, flat))
            continue
        while start < flat.numel():
            take = min(flat.numel() - start, room // size)
            if take == 0:
                if bucket:  # no room left for one element: close this bucket
                    yield bucket
                    bucket, room = [], bucket_bytes
                    continue
                take = 1  # an element larger than a whole bucket
            # a copy: a pickled view would carry its whole tensor's storage
            bucket.append(Piece(name, tuple(tensor.shape), tensor.dtype, start, flat[start:start + take].clone()))
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
            end = piece.start + piece.data.numel()
            if piece.start < 0 or end > numel or piece.data.dtype != piece.dtype:
                raise SpecError.single(f"{piece.name}: a piece [{piece.start}, {end}) outside its {numel} elements",
                                       "bucket")
            flat[piece.start:end] = piece.data
            missing -= piece.data.numel()
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
