"""Reading a record back from an output file: a PNG's ``omnispec`` text chunk, a JPEG's or GIF's comment, an MP4's
``comment`` tag, or the ``<file>.json`` beside a ``.npy``, ``.wav`` or ``.webp``.

An output handed to ``run --from``, ``omnispec.replay`` or ``explain`` may come from anyone. Its record's text is
measured before it is decoded (``bounded.RECORD``: size, depth, values), then validated as a ``Record``; a file
that is not an image, is truncated or is a FIFO is one ``SpecError`` naming it.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from pathlib import Path

from ..spec.bounded import RECORD, decode_utf8, parse_json
from ..spec.errors import SpecError
from ..spec.files import path_kind, read_bytes, regular_file
from ..spec.images import IMAGE_FORMATS
from ..spec.videos import checked_container, import_pyav, open_demuxer
from .schema import FORMAT, KEY, Record, parse_record

SIDECAR_SUFFIXES = (".npy", ".wav", ".webp")  # formats without a place for text: a <file>.json beside them
OUTPUT_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".mp4", ".npy", ".wav")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_PNG_CHUNKS = 1_000_000


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def is_output(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that can carry a record (as opposed to a spec)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return False
    if suffix == ".json":
        return p.name.endswith(tuple(f"{s}.json" for s in SIDECAR_SUFFIXES)) or _json_is_record(p)
    return suffix in OUTPUT_SUFFIXES


def _json_is_record(path: Path) -> bool:
    """A ``.json`` written as a record (not a spec written as JSON): it has a record's marker and keys."""
    try:
        data = parse_json(decode_utf8(read_bytes(path, RECORD.bytes, "record"), str(path)), str(path), RECORD)
    except (OSError, SpecError):  # too large, too deep, not JSON: read as a spec, which says why
        return False
    return isinstance(data, dict) and {KEY, "spec", "request", "versions"} <= set(data)


def read(path: str | os.PathLike[str]) -> Record:
    """The record of an output file (or of its ``.json`` sidecar); ``SpecError`` when it has none or it is invalid."""
    path = regular_file(path, what="output file")
    text = _record_text(path)
    if text is None:
        raise SpecError.single("records nothing about how it was made (not written by omnispec, or its metadata "
                               "was stripped)", file=str(path))
    if len(text.encode("utf-8")) > RECORD.bytes:
        raise SpecError.single(f"its record was not read: larger than {RECORD.bytes:,} bytes, the limit for "
                               f"{RECORD.what}", file=str(path))
    try:
        data = parse_json(text, str(path), RECORD)
    except SpecError as exc:
        raise SpecError.single(f"its omnispec record was not read: {exc.problems[0].message}", file=str(path)) from None
    return parse_record(data, str(path))


def _record_text(path: Path) -> str | None:
    """The record's text: a format that carries its own (PNG, JPEG, GIF, MP4) is read alone, so a ``<file>.json``
    dropped beside it can neither replace its record nor make it unreadable; the others read their sidecar."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return decode_utf8(read_bytes(path, RECORD.bytes, "record"), str(path))
    if suffix in SIDECAR_SUFFIXES and path_kind(sidecar(path)) is not None:
        side = sidecar(path)
        return decode_utf8(read_bytes(side, RECORD.bytes, "record"), str(side))
    if suffix == ".png":
        return _png_text(path, KEY)
    if suffix in (".jpg", ".jpeg", ".gif", ".webp"):
        return _image_comment(path)
    if suffix == ".mp4":
        return _mp4_comment(path)
    return None


def _png_text(path: Path, key: str) -> str | None:
    """The text of a PNG's ``key`` text chunk (iTXt, tEXt or zTXt), read chunk by chunk without decoding the image.

    A chunk reader of our own rather than PIL's: PIL decodes every text chunk it meets (up to 64 MB) and reads a
    decompression bomb's header as an image; here each chunk's length is checked against the record bound before
    its data is read, compressed text is inflated only up to that bound, and pixel data is skipped unread."""
    limit = RECORD.bytes
    with path.open("rb") as f:
        if f.read(8) != _PNG_SIGNATURE:
            raise SpecError.single("not a PNG file (its signature is missing)", file=str(path))
        for _ in range(_MAX_PNG_CHUNKS):
            head = f.read(8)
            if len(head) < 8:
                return None  # truncated before IEND: no record in what is there
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                return None
            if kind not in (b"iTXt", b"tEXt", b"zTXt"):
                f.seek(length + 4, os.SEEK_CUR)
                continue
            start = f.tell()
            keyword = f.read(80).split(b"\0", 1)[0]
            if keyword != key.encode("latin-1"):
                f.seek(start + length + 4)
                continue
            if length > limit + 1024:
                raise SpecError.single(f"its record was not read: a {length:,}-byte text chunk, above the "
                                       f"{limit:,}-byte limit for {RECORD.what}", file=str(path))
            f.seek(start)
            data = f.read(length)
            if len(data) < length:
                raise SpecError.single("its record's text chunk is truncated", file=str(path))
            return _png_chunk_text(kind, data[len(keyword) + 1:], limit, path)
    raise SpecError.single(f"more than {_MAX_PNG_CHUNKS:,} PNG chunks: not read", file=str(path))


def _png_chunk_text(kind: bytes, body: bytes, limit: int, path: Path) -> str:
    if kind == b"tEXt":
        return body.decode("latin-1")
    if kind == b"zTXt":
        return _inflate(body[1:], limit, path).decode("latin-1")
    flag, _method = body[0:1], body[1:2]  # iTXt: compression flag and method, language, translated keyword, text
    rest = body[2:].split(b"\0", 2)
    if len(rest) < 3:
        raise SpecError.single("its record's text chunk is malformed", file=str(path))
    text = _inflate(rest[2], limit, path) if flag == b"\x01" else rest[2]
    return decode_utf8(text, str(path))


def _inflate(data: bytes, limit: int, path: Path) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise SpecError.single(f"its record's compressed text is corrupt: {exc}", file=str(path)) from None
    if len(out) > limit:
        raise SpecError.single(f"its record was not read: it inflates past {limit:,} bytes, the limit for "
                               f"{RECORD.what}", file=str(path))
    return out


def _image_comment(path: Path) -> str | None:
    """A JPEG's or GIF's comment, read by PIL without decoding the pixels (a decompression bomb is refused)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=IMAGE_FORMATS) as image:
                text = image.info.get("comment")
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise SpecError.single(f"not a readable image: {exc}", file=str(path)) from None
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


def _mp4_comment(path: Path) -> str | None:
    """An MP4's ``comment`` tag, read as a conditioning video is opened: its first bytes name the container, its
    boxes are checked within bounds, FFmpeg demuxes that container alone and opens nothing else."""
    av = import_pyav("reading an .mp4's record", file=str(path))
    container = checked_container(path, what="output file")
    try:
        with path.open("rb") as handle, open_demuxer(av, handle, container) as opened:
            return opened.metadata.get("comment")
    except Exception as exc:  # noqa: BLE001 - PyAV raises its own error types for every kind of bad container
        raise SpecError.single(f"not a readable MP4: {exc}", file=str(path)) from None


__all__ = ["FORMAT", "KEY", "OUTPUT_SUFFIXES", "SIDECAR_SUFFIXES", "is_output", "read", "sidecar"]
