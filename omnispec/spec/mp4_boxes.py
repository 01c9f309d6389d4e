"""MP4/MOV files (ISO base media) walked box by box, within bounds, before FFmpeg reads them.

FFmpeg's MOV demuxer believes the entry counts of a file's sample tables: it allocates what a count claims and
builds an index entry (tens of bytes) for every sample a track or a fragment lists, and again for every edit that
shows the samples. A few kilobytes claiming a hundred million samples fill gigabytes before any frame is decoded.
So the boxes are read here first, headers and counts only, and a file is refused when a table's entries do not fit
in its box, when a track's index (samples times edits) or its fragments' samples pass ``MAX_MEDIA_SAMPLES``, when
constant-size samples claim more bytes than the file holds, or when the boxes themselves are malformed (a size
past its parent's end, too deep, too many). Encrypted files are refused too: nothing here holds their keys.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .base import MAX_MEDIA_SAMPLES
from .errors import SpecError

# Boxes whose payload is a sequence of boxes, walked into; every other box is skipped by its size.
CONTAINER_BOXES = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"mvex", b"moof",
                             b"traf", b"mfra"})
# Tables FFmpeg allocates by their count: box -> (offset of the 32-bit count after version and flags, entry bytes,
# entry bytes of version 1 where it differs).
COUNTED_TABLES = {b"stco": (4, 4, 4), b"co64": (4, 8, 8), b"stts": (4, 8, 8), b"ctts": (4, 8, 8),
                  b"stsc": (4, 12, 12), b"stss": (4, 4, 4), b"stps": (4, 4, 4), b"elst": (4, 12, 20)}
# Sample-group tables: the count follows a grouping type and, from version 1 on, one more 32-bit field; each
# description takes at least a byte, each group assignment 8.
GROUP_TABLES = {b"sgpd": 1, b"sbgp": 8}
ENCRYPTION_BOXES = frozenset({b"senc", b"pssh", b"sinf", b"tenc"})
ENCRYPTED_ENTRIES = frozenset({"encv", "enca"})
MAX_BOXES = 250_000  # a fragmented file of 10,000 frames, one fragment each, has about 70,000
MAX_DEPTH = 16  # a sample table lies 5 boxes deep


@dataclass
class Track:
    """What one ``trak`` box declares: its handler (``vide``, ``soun``...), its first sample entry's format (the
    codec's four characters), and the counts that size FFmpeg's index of it."""

    handler: str = ""
    codec: str = ""
    samples: int = 0
    constant_size: bool = False
    chunks: int = 0
    edits: int = 0
    unit_durations: bool = False

    @property
    def indexed(self) -> int:
        """Index entries FFmpeg makes: one per sample, or one per chunk for constant-size audio whose every sample
        lasts one tick (uncompressed audio, demuxed chunk by chunk), each repeated for every edit."""
        by_chunk = self.handler == "soun" and self.constant_size and self.unit_durations
        return (self.chunks if by_chunk else self.samples) * max(self.edits, 1)


@dataclass
class IsoMedia:
    """The tracks of an MP4/MOV file as its boxes declare them."""

    tracks: list[Track] = field(default_factory=list)
    fragment_samples: int = 0

    def video_codec(self) -> str:
        """The sample format of the first video track ('' where there is none)."""
        return next((t.codec for t in self.tracks if t.handler == "vide"), "")


def iso_media(file: Path, path: str, where: str) -> IsoMedia:
    """The file's tracks, after every box is checked (see the module's docstring); ``SpecError`` naming the file
    and the first problem otherwise."""
    size = file.stat().st_size
    walk = _Walk(path, where, size)
    with file.open("rb") as handle:
        walk.boxes(handle, 0, size, 0)
    for number, track in enumerate(walk.media.tracks, 1):
        walk.check_track(track, number)
    return walk.media


class _Walk:
    """One pass over a file's boxes, collecting tracks and refusing the first problem."""

    def __init__(self, path: str, where: str, size: int) -> None:
        self.path, self.where, self.size = path, where, size
        self.media = IsoMedia()
        self.count = 0
        self.track = Track()  # where tables outside any trak go: FFmpeg applies them to its last stream

    def refuse(self, problem: str) -> SpecError:
        return SpecError.single(f"{self.path}: not a readable video (MP4/MOV): {problem}", self.where)

    def boxes(self, handle: BinaryIO, start: int, end: int, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise self.refuse(f"boxes nested more than {MAX_DEPTH} deep")
        at = start
        while at < end:
            kind, header, size = self.header(handle, at, end)
            self.count += 1
            if self.count > MAX_BOXES:
                raise self.refuse(f"more than {MAX_BOXES:,} boxes")
            self.box(handle, kind, at + header, at + size, depth)
            at += size

    def header(self, handle: BinaryIO, at: int, end: int) -> tuple[bytes, int, int]:
        """A box's type, header length and total size; a size of 0 runs to the end of its parent."""
        handle.seek(at)
        raw = handle.read(16)
        if end - at < 8 or len(raw) < 8:
            raise self.refuse(f"{end - at} stray bytes at byte {at:,} (truncated?)")
        size, kind = struct.unpack(">I4s", raw[:8])
        header = 8
        if size == 1:
            if len(raw) < 16:
                raise self.refuse(f"box {_name(kind)} at byte {at:,} is truncated")
            size, header = struct.unpack(">Q", raw[8:16])[0], 16
        elif size == 0:
            size = end - at
        if size < header or size > end - at:
            raise self.refuse(f"box {_name(kind)} at byte {at:,} claims {size:,} bytes, "
                              f"{'less than its header' if size < header else f'past the {end - at:,} left'}"
                              " (truncated or corrupt)")
        return kind, header, size

    def box(self, handle: BinaryIO, kind: bytes, start: int, end: int, depth: int) -> None:
        if kind in ENCRYPTION_BOXES:
            raise self.refuse(f"an encrypted file (box {_name(kind)}), which omnispec cannot decode")
        if kind == b"trak":  # FFmpeg reads every table that follows into the last track it opened, as here
            self.track = Track()
            self.media.tracks.append(self.track)
            self.boxes(handle, start, end, depth + 1)
        elif kind in CONTAINER_BOXES:
            self.boxes(handle, start, end, depth + 1)
        else:
            self.leaf(kind, self.payload(handle, start, end, 24), end - start)

    @staticmethod
    def payload(handle: BinaryIO, start: int, end: int, limit: int) -> bytes:
        handle.seek(start)
        return handle.read(min(limit, end - start))

    def leaf(self, kind: bytes, head: bytes, length: int) -> None:
        """Checks a box that is not a container from its first bytes (``head``) and its payload's ``length``."""
        track = self.track
        if kind == b"hdlr" and len(head) >= 12 and head[4:8] != b"dhlr":  # QuickTime's data handler names no media
            track.handler = head[8:12].decode("latin-1")
        elif kind == b"stsd" and len(head) >= 16:
            track.codec = head[12:16].decode("latin-1")
            if track.codec in ENCRYPTED_ENTRIES:
                raise self.refuse(f"an encrypted track (sample entry {track.codec!r}), which omnispec cannot decode")
        elif kind == b"stsz":
            self.sample_sizes(track, head, length)
        elif kind == b"stz2":
            count = self.counted(kind, head, 8, length, 0)
            bits = head[7] if len(head) > 7 else 0
            self.fits(kind, count, (count * bits + 7) // 8, length - 12)
            track.samples = max(track.samples, count)
        elif kind == b"trun":
            self.fragment_run(head, length)
        elif kind in GROUP_TABLES:
            self.counted(kind, head, 12 if head[:1] not in (b"", b"\x00") else 8, length, GROUP_TABLES[kind])
        elif kind in COUNTED_TABLES:
            offset, entry, entry_v1 = COUNTED_TABLES[kind]
            count = self.counted(kind, head, offset, length, entry_v1 if head[:1] == b"\x01" else entry)
            if kind in (b"stco", b"co64"):
                track.chunks = max(track.chunks, count)
            elif kind == b"elst":
                track.edits = max(track.edits, count)
            elif kind == b"stts":
                track.unit_durations = count == 1 and len(head) >= 16 and head[12:16] == b"\0\0\0\x01"

    def counted(self, kind: bytes, head: bytes, offset: int, length: int, entry: int) -> int:
        """A table's count, refused unless its entries fit in the box after the count."""
        if len(head) < offset + 4:
            raise self.refuse(f"box {_name(kind)} is truncated ({length} bytes)")
        count = struct.unpack(">I", head[offset:offset + 4])[0]
        self.fits(kind, count, count * entry, length - offset - 4)
        return count

    def fits(self, kind: bytes, count: int, needed: int, room: int) -> None:
        if needed > room:
            raise self.refuse(f"box {_name(kind)} claims {count:,} entries, {needed:,} bytes, in {max(room, 0):,} "
                              "bytes")

    def sample_sizes(self, track: Track, head: bytes, length: int) -> None:
        """``stsz``: one size for every sample, or a table of sizes; either way the samples lie in this file."""
        if len(head) < 12:
            raise self.refuse(f"box 'stsz' is truncated ({length} bytes)")
        constant, count = struct.unpack(">II", head[4:12])
        if constant:
            if count * constant > self.size:
                raise self.refuse(f"box 'stsz' claims {count:,} samples of one size, {count * constant:,} bytes in "
                                  f"all, more than the file holds ({self.size:,} bytes)")
        else:
            self.fits(b"stsz", count, count * 4, length - 12)
        track.samples, track.constant_size = max(track.samples, count), bool(constant)

    def fragment_run(self, head: bytes, length: int) -> None:
        """``trun``: a fragment's samples, each with the fields its flags name (4 bytes each)."""
        if len(head) < 8:
            raise self.refuse(f"box 'trun' is truncated ({length} bytes)")
        flags, count = int.from_bytes(head[1:4], "big"), int.from_bytes(head[4:8], "big")
        optional = 4 * (flags & 0x5).bit_count()  # the data offset, the first sample's flags
        per_sample = 4 * (flags & 0xF00).bit_count()  # duration, size, flags, composition offset
        self.fits(b"trun", count, optional + count * per_sample, length - 8)
        self.media.fragment_samples += count
        if self.media.fragment_samples > MAX_MEDIA_SAMPLES:
            raise self.refuse(f"its fragments list more than {MAX_MEDIA_SAMPLES:,} samples, the limit for a file")

    def check_track(self, track: Track, number: int) -> None:
        if track.indexed > MAX_MEDIA_SAMPLES:
            edits = f" shown by {track.edits:,} edits" if track.edits > 1 else ""
            raise self.refuse(f"track {number} ({track.handler or 'no handler'}) indexes {track.samples:,} "
                              f"samples{edits}, above the limit of {MAX_MEDIA_SAMPLES:,} for a file")


def _name(kind: bytes) -> str:
    """A box type as the file spells it, or its bytes in hex where they are not printable ASCII."""
    text = kind.decode("latin-1")
    return repr(text) if text.isascii() and text.isprintable() else f"0x{kind.hex()}"


__all__ = ["IsoMedia", "Track", "iso_media"]
