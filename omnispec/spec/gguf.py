"""A GGUF file's header (metadata and tensor table) read as data, within bounds, before any library opens the file.

gguf-py's ``GGUFReader`` (what diffusers' loader uses) memory-maps the whole file and parses every field in a Python
loop with no bound on the counts the file declares, so a few forged bytes (a tensor count of 2**60, a million empty
strings) would make it run for minutes or fail with a library traceback. This reader takes only the header, checks
each count and length against the file's size and our bounds as it goes, and ends in one ``SpecError`` naming the
file and the first problem. The tensor types' block sizes are ggml's (the same table as gguf-py's
``GGML_QUANT_SIZES``, which a test compares with this one).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from .errors import SpecError
from .files import TensorEntry, overflowing, regular_file

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bounds far above real files: a 19B-parameter denoiser has about 4,000 tensors and 10 metadata keys; a language
# model's GGUF carries its vocabulary (arrays of ~150,000 strings) in the header, a few tens of MB.
MAX_TENSORS = 100_000
MAX_KEYS = 10_000
MAX_DIMS = 8
# Entries of all the metadata arrays together. A denoiser's or a VAE's GGUF carries none (a language model's
# vocabulary does, but omnispec loads text encoders from their folders); gguf-py's reader, which the loader runs after
# this one, keeps each array entry as numpy views of its own (a million of them take hundreds of MB to read).
MAX_ARRAY_ENTRIES = 100_000
MAX_STRING = 1 << 20
MAX_HEADER_BYTES = 256 << 20
# ggml tensor type id -> (name, values per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Types stored as plain numbers (loaders hand them back as ordinary tensors); the rest are quantized blocks.
PLAIN_TYPES = frozenset({"F32", "F16", "F64", "I8", "I16", "I32", "I64"})
# Metadata value types: id -> struct format (fixed-size scalars); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor(TensorEntry):
    """One tensor of the file: its ggml type as ``dtype`` (``Q4_0``, ``F32`` ...), its shape in torch's order (ggml
    lists dimensions innermost first), and its bytes' range from the start of the file."""

    @property
    def quantized(self) -> bool:
        return self.dtype not in PLAIN_TYPES


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, by its entries' type and count: omnispec reads no array's values, so none is kept."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each ggml type, most common first (``Q4_0: 240, F32: 160``)."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))


class _Reader:
    """Reads a file's header front to back, never past the file's end or the header bound."""

    def __init__(self, f: BinaryIO, size: int, refuse: Any) -> None:
        self.f, self.size, self.refuse, self.position = f, size, refuse, 0
        self.array_entries = 0

    def take(self, n: int, what: str) -> bytes:
        self._advance(n, what)
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        self._advance(n, what)
        self.f.seek(n, os.SEEK_CUR)

    def _advance(self, n: int, what: str) -> None:
        if n > self.size - self.position:
            raise self.refuse(f"{what} needs {n:,} bytes at offset {self.position:,}, past the file's end "
                              f"({self.size:,} bytes; truncated?)")
        if self.position + n > MAX_HEADER_BYTES:
            raise self.refuse(f"its header runs past {MAX_HEADER_BYTES >> 20} MiB, far beyond any real model's")
        self.position += n

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, limit: int, what: str) -> int:
        value = self.scalar("<Q", what)
        if value > limit:
            raise self.refuse(f"it declares {value:,} {what}, more than the {limit:,} allowed")
        return value

    def string(self, what: str) -> str:
        length = self.count(MAX_STRING, f"bytes in {what}")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], f"the value of {key!r}")
        if kind == _STRING:
            return self.string(f"the value of {key!r}")
        if kind == _ARRAY:
            return self.array(key)
        raise self.refuse(f"the value of {key!r} has unknown type {kind}")

    def array(self, key: str) -> GGUFArray:
        """An array's entries passed over, within the bound on all arrays' entries together."""
        item = self.scalar("<I", f"the array type of {key!r}")
        length = self.scalar("<Q", f"the length of the array {key!r}")
        self.array_entries += length
        if self.array_entries > MAX_ARRAY_ENTRIES:
            raise self.refuse(f"it declares {length:,} entries in the array {key!r}, which bring its metadata arrays "
                              f"past the {MAX_ARRAY_ENTRIES:,} entries allowed (a denoiser's GGUF has none)")
        if item in _SCALARS:
            self.skip(length * struct.calcsize(_SCALARS[item]), f"the array {key!r}")
        elif item == _STRING:
            for _ in range(length):
                self.skip(self.count(MAX_STRING, f"bytes in an entry of {key!r}"), f"an entry of {key!r}")
        else:
            raise self.refuse(f"the array {key!r} holds entries of unknown type {item}"
                              + (" (an array of arrays)" if item == _ARRAY else ""))
        return GGUFArray(item, length)


def gguf_header(path: str | os.PathLike[str], where: str = "") -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked as a loader would need it: the magic and a known version,
    counts and lengths within bounds and the file, every tensor of a known type with a shape whose innermost
    dimension is a whole number of blocks, and each tensor's bytes inside the file, aligned, not overlapping
    another's. Reads no tensor data."""
    p = regular_file(path, where, "GGUF file")
    size = p.stat().st_size

    def refuse(problem: str) -> SpecError:
        return SpecError.single(f"{p}: not a valid GGUF file: {problem}", where)

    with p.open("rb") as f:
        r = _Reader(f, size, refuse)
        magic = r.take(4, "the magic number") if size >= 4 else b""
        if magic != MAGIC:
            raise refuse(f"it starts with {magic!r}, not {MAGIC!r}")
        version = r.scalar("<I", "the version")
        if version not in VERSIONS:
            raise refuse(f"version {version}; GGUF versions {' and '.join(map(str, VERSIONS))} are read")
        n_tensors = r.count(MAX_TENSORS, "tensors")
        n_keys = r.count(MAX_KEYS, "metadata keys")
        metadata: dict[str, Any] = {}
        for _ in range(n_keys):
            key = r.string("a metadata key")
            metadata[key] = r.value(r.scalar("<I", f"the type of {key!r}"), key)
        infos = []
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            dims = r.scalar("<I", f"the dimensions of {name!r}")
            if not 0 < dims <= MAX_DIMS:
                raise refuse(f"tensor {name!r} has {dims} dimensions")
            shape = [r.scalar("<Q", f"the shape of {name!r}") for _ in range(dims)]
            kind = r.scalar("<I", f"the type of {name!r}")
            offset = r.scalar("<Q", f"the offset of {name!r}")
            infos.append((name, shape, kind, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= 1 << 20 \
            or alignment & (alignment - 1):
        raise refuse(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-r.position // alignment) * alignment
    tensors = _tensors(infos, data_start, size, alignment, refuse)
    return GGUFHeader(version, metadata, tensors)


def _tensors(infos: list[tuple[str, list[int], int, int]], data_start: int, size: int, alignment: int,
             refuse: Any) -> dict[str, GGUFTensor]:
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, kind, offset in infos:
        if name in tensors:
            raise refuse(f"tensor {name!r} is listed twice")
        if kind not in GGML_TYPES:
            raise refuse(f"tensor {name!r} has unknown ggml type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        if overflowing(shape):
            raise refuse(f"tensor {name!r}: shape {list(reversed(shape))} has strides past 64 bits (no tensor can "
                         "have it)")
        if shape[0] % block:
            raise refuse(f"tensor {name!r}: {type_name} stores blocks of {block} values, and its innermost "
                         f"dimension is {shape[0]}")
        count = math.prod(shape)
        begin = data_start + offset
        end = begin + count // block * block_bytes
        if offset % alignment:
            raise refuse(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
        if end > size:
            raise refuse(f"tensor {name!r}: bytes {begin:,}..{end:,} lie past the file's end ({size:,} bytes; "
                         "truncated?)")
        tensors[name] = GGUFTensor(type_name, tuple(reversed(shape)), begin, end)
    position = data_start
    for name, tensor in sorted(tensors.items(), key=lambda item: item[1].begin):
        if tensor.begin < position:
            raise refuse(f"tensor {name!r}: its bytes overlap the tensor before")
        position = tensor.end
    return tensors


__all__ = ["GGML_TYPES", "PLAIN_TYPES", "GGUFArray", "GGUFHeader", "GGUFTensor", "gguf_header"]
