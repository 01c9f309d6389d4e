"""Files a user hands omnispec, opened as data: checked to be regular files, measured before reading, parsed within
bounds, and never unpickled.

A checkpoint folder, a LoRA, an image or an output record may be hostile (a FIFO that blocks ``open``, a header
claiming petabytes, a pickle that runs code when loaded). These readers refuse each with one ``SpecError`` that
names the file and what is wrong, before any library sees it.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bounded import CONFIG, TOKENIZER, Bounds, check_json_depth, decode_utf8, parse_json
from .errors import SpecError

# Weight formats that torch.load unpickles (running whatever code the file names): refused by name unless the
# user trusts the files (--trust-code / trust_code=True).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".safetensors.bin")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# Bits per value of each safetensors dtype (the format's own list; F4 and F6 pack values below a byte).
SAFETENSORS_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
                          "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64,
                          "U32": 32, "U16": 16, "U8": 8, "BOOL": 8}
# safetensors' own reader refuses headers above 100 MB; ours stops at the config bound (16 MiB: a 19B model's
# header is about 0.5 MB).
MAX_SAFETENSORS_HEADER = CONFIG.bytes


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` names, links followed: ``"dir"``, ``"file"`` (a regular file), ``"other"`` (a FIFO, a device,
    a socket), or None when the OS finds nothing to stat there: absent, a dangling link, a name too long, a loop of
    links, a NUL in it, no permission. Never raises: Python 3.11's ``Path.exists``/``is_dir`` raise for a name too
    long, so a user's 5,000-character path would otherwise be a traceback."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def user_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` expanded, or as written when it cannot be (``~nosuchuser``: ``expanduser`` raises
    RuntimeError), so that a check saying it is absent follows."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def regular_file(path: str | os.PathLike[str], where: str = "", what: str = "file") -> Path:
    """``path`` as a ``Path`` when it is a regular file (links followed); otherwise ``SpecError`` saying what it is,
    decided from ``stat`` alone: a FIFO or a device is never opened (opening one can block forever)."""
    if not os.fspath(path):  # Path("") is the working directory
        raise SpecError.single(f"an empty path where a {what} was expected", where)
    p = Path(path)
    try:
        info = p.stat()
    except FileNotFoundError:
        raise SpecError.single(f"no such {what}: {p}", where) from None
    except OSError as exc:  # a name too long, a loop of links, permissions
        raise SpecError.single(f"cannot read {what} {p}: {exc.strerror or exc}", where) from None
    except ValueError:  # a NUL in the name
        raise SpecError.single(f"cannot read {what} {str(p)!r}: a path cannot contain a NUL character", where) from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        raise SpecError.single(f"{p} is {kind}, not a {what}", where)
    return p


def read_bytes(path: str | os.PathLike[str], limit: int, what: str, where: str = "") -> bytes:
    """A regular file's bytes, refused unread when it is larger than ``limit``."""
    p = regular_file(path, where, what)
    size = p.stat().st_size
    if size > limit:
        raise SpecError.single(f"{p}: not read: {size:,} bytes, above the {limit:,}-byte limit for {what}s", where)
    try:
        with p.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise SpecError.single(f"cannot read {what} {p}: {exc.strerror or exc}", where) from None
    if len(raw) > limit:  # it grew while we looked
        raise SpecError.single(f"{p}: not read: larger than the {limit:,}-byte limit for {what}s", where)
    return raw


def read_json_file(path: str | os.PathLike[str], bounds: Bounds = CONFIG, where: str = "") -> Any:
    """A JSON file's data within ``bounds`` (size, depth, values); errors name the file."""
    raw = read_bytes(path, bounds.bytes, bounds.what.removeprefix("a "), where)
    try:
        return parse_json(decode_utf8(raw, str(path)), str(path), bounds)
    except SpecError as exc:
        problem = exc.problems[0]
        raise SpecError.single(problem.message, where or problem.path, str(path)) from None


# JSON files of a component folder that tokenizer libraries read themselves and that may be tens of MB.
LARGE_JSON = ("tokenizer.json", "vocab.json")


def check_json_files(folder: Path, where: str) -> None:
    """Every ``*.json`` of a component folder that diffusers or transformers would read themselves (config.json,
    tokenizer and processor configs, generation_config.json, an index), read within bounds first, so a deep, huge or
    non-regular one is refused here by name instead of failing inside a loader; an index's ``weight_map`` is
    checked (``index_shards``). Vocabulary files are measured (size, depth) without being decoded."""
    for path in sorted(folder.glob("*.json")):
        if path.name in LARGE_JSON:
            raw = read_bytes(path, TOKENIZER.bytes, TOKENIZER.what.removeprefix("a "), where)
            try:
                check_json_depth(decode_utf8(raw, str(path)), str(path), TOKENIZER)
            except SpecError as exc:
                raise SpecError.single(exc.problems[0].message, where, str(path)) from None
            continue
        data = read_json_file(path, CONFIG, where)
        if path.name.endswith(".safetensors.index.json"):
            index_shards(data, path)


def index_shards(data: Any, index: Path) -> list[str]:
    """The shard files a ``*.safetensors.index.json`` names: its ``weight_map`` must map tensor names to file names
    in the index's own folder (no path parts), else ``SpecError`` naming the index."""
    shards = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(k, str) and isinstance(v, str) and v and "/" not in v
                                               and "\\" not in v and not v.startswith(".")
                                               for k, v in shards.items()):
        raise SpecError.single("weight_map is not a mapping of tensor names to shard files in this folder",
                               file=str(index))
    return sorted(set(shards.values()))


def refuse_pickle(path: str | os.PathLike[str], where: str, trusted: bool = False) -> None:
    """A weights file torch would unpickle is refused by its name, before anything reads it (unless trusted)."""
    name = Path(path).name.lower()
    if not trusted and name.endswith(PICKLE_SUFFIXES):
        raise SpecError.single(f"{path}: a pickled weights file, which loading would run code from; omnispec reads "
                               "weights from .safetensors (or .gguf) files only, unless you pass --trust-code "
                               "(trust_code=True) for files you trust", where)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def safetensors_header(path: str | os.PathLike[str], where: str = "") -> SafetensorsHeader:
    """A safetensors file's header, read and checked without reading any tensor, as strictly as the safetensors
    library reads it (so no file passes here and fails inside a loader): its length within the file and the bound,
    JSON text starting with ``{`` (no BOM) within the config bounds, each tensor's dtype known, its shape
    non-negative integers, its byte range the size its shape and dtype give (in bits: F4 packs two values a byte),
    and the ranges, in order, following each other from 0 to the end of the file (no gap, no trailing bytes). A
    truncated or forged file is one ``SpecError`` naming the file and the first problem."""
    p = regular_file(path, where, "safetensors file")
    size = p.stat().st_size

    def refuse(problem: str) -> SpecError:
        return SpecError.single(f"{p}: not a valid safetensors file: {problem}", where)

    if size < 8:
        raise refuse(f"{size} bytes, shorter than the 8-byte header length")
    with p.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise refuse(f"its header claims {length:,} bytes" + (f", more than the file's {size - 8:,} after the "
                         "length" if length > size - 8 else f", above the {MAX_SAFETENSORS_HEADER:,}-byte limit"))
        raw = f.read(length)
    if not raw.startswith(b"{"):
        raise refuse(f"its header does not start with '{{' (it starts with {raw[:8]!r})")
    try:
        data = parse_json(decode_utf8(raw, str(p)), str(p), CONFIG)
    except SpecError as exc:
        raise refuse(f"header {exc.problems[0].message}") from None
    if not isinstance(data, dict):
        raise refuse("the header is not a JSON object")
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise refuse("__metadata__ is not a mapping of strings")
    data_bytes = size - 8 - length
    tensors: dict[str, TensorEntry] = {}
    for name, info in data.items():
        entry = _tensor_entry(name, info, data_bytes)
        if isinstance(entry, str):
            raise refuse(entry)
        tensors[name] = entry
    problem = _layout_problem(tensors, data_bytes)
    if problem:
        raise refuse(problem)
    return SafetensorsHeader(tensors, metadata)


def _layout_problem(tensors: dict[str, TensorEntry], data_bytes: int) -> str | None:
    """What the safetensors library refuses in the tensors' byte ranges: in order of their offsets, each starts where
    the one before ends (the first at 0), and the last ends at the end of the file."""
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            kind = "overlap the tensor before" if entry.begin < position else "leave a gap after the tensor before"
            return f"tensor {name!r}: bytes {entry.begin}..{entry.end} {kind} (which ends at {position})"
        position = entry.end
    if position != data_bytes:
        return f"{data_bytes - position:,} bytes after the last tensor's data (the tensors end at {position:,})"
    return None


def overflowing(shape: list[int] | tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` would have a stride (or an element count) past a signed 64-bit integer: a
    dimension of size 0 makes the tensor empty, so its byte count is 0 whatever the other dimensions claim, and torch
    refuses to make it ("Stride calculation overflowed")."""
    return math.prod(max(d, 1) for d in shape) >= 1 << 63


def _tensor_entry(name: str, info: Any, data_bytes: int) -> TensorEntry | str:
    """The header's entry for one tensor, or what is wrong with it."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        return f"tensor {name!r}: expected dtype, shape and data_offsets, got {info!r:.80}"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in SAFETENSORS_DTYPE_BITS:
        return f"tensor {name!r}: unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return f"tensor {name!r}: shape {shape!r:.80} is not a list of sizes"
    if overflowing(shape):
        return f"tensor {name!r}: shape {shape} has strides past 64 bits (no tensor can have it)"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                    for o in offsets)):
        return f"tensor {name!r}: data_offsets {offsets!r:.80} is not [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        return f"tensor {name!r}: bytes {begin}..{end} lie outside the file's {data_bytes:,} bytes of data (truncated?)"
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if bits % 8:
        return f"tensor {name!r}: shape {shape} of {dtype} is {bits} bits, not a whole number of bytes"
    if end - begin != bits // 8:
        return f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype} ({bits // 8} expected)"
    return TensorEntry(dtype, tuple(shape), begin, end)


__all__ = ["PICKLE_SUFFIXES", "SAFETENSORS_DTYPE_BITS", "WEIGHT_SUFFIXES", "SafetensorsHeader", "TensorEntry",
           "check_json_files", "index_shards", "overflowing", "path_kind", "read_bytes", "read_json_file",
           "refuse_pickle", "regular_file", "safetensors_header", "user_path"]
