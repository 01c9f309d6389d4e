"""An animated GIF's frames measured from its blocks, before PIL decodes any of them.

PIL grows a GIF's canvas when a later frame's rectangle reaches past it, and allocates that canvas (and a disposal
image of the frame's size) while it seeks to the frame, before any size check of ours could run on the decoded
frame; a truncated file fails inside PIL's parser with ``struct.error`` or ``IndexError``. So the block structure
is read here first: the logical screen, each image's rectangle, every sub-block's length, the trailer. The result
is the canvas size after each frame, as PIL will compute it; a file that ends inside a block or before its
trailer is refused as truncated.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from .errors import SpecError

GIF_SIGNATURES = (b"GIF87a", b"GIF89a")
_EXTENSION, _IMAGE, _TRAILER = 0x21, 0x2C, 0x3B


def is_gif(head: bytes) -> bool:
    return head[:6] in GIF_SIGNATURES


def gif_canvases(file: Path, path: str, where: str, max_frames: int) -> list[tuple[int, int]]:
    """(width, height) of the canvas after each frame, at most ``max_frames + 1`` of them (enough to refuse one
    frame too many); ``SpecError`` naming the file where its blocks are truncated or malformed."""
    with file.open("rb") as handle:
        return _Blocks(handle, path, where).canvases(max_frames)


class _Blocks:
    """A GIF read block by block: only lengths and rectangles are kept, pixel data is skipped."""

    def __init__(self, handle: BinaryIO, path: str, where: str) -> None:
        self.handle, self.path, self.where = handle, path, where
        self.size = os.fstat(handle.fileno()).st_size

    def refuse(self, problem: str) -> SpecError:
        return SpecError.single(f"{self.path}: not a readable GIF: {problem}", self.where)

    def read(self, count: int, what: str) -> bytes:
        data = self.handle.read(count)
        if len(data) < count:
            raise self.refuse(f"it ends inside {what} (truncated)")
        return data

    def canvases(self, max_frames: int) -> list[tuple[int, int]]:
        screen = self.read(13, "its header")
        width, height, flags = struct.unpack("<HHB", screen[6:11])
        self.color_table(flags, "its global colour table")
        canvas, sizes = (width, height), []
        while len(sizes) <= max_frames:
            introducer = self.handle.read(1)
            if not introducer:
                raise self.refuse(f"it ends after {len(sizes)} frame(s) without the GIF trailer (truncated)")
            if introducer[0] == _TRAILER:
                break
            if introducer[0] == _EXTENSION:
                self.read(1, "an extension")
                self.sub_blocks(f"an extension after frame {len(sizes) - 1}" if sizes else "an extension")
            elif introducer[0] == _IMAGE:
                canvas = self.image(canvas, len(sizes))
                sizes.append(canvas)
            # any other byte is skipped, as PIL skips it
        return sizes

    def image(self, canvas: tuple[int, int], k: int) -> tuple[int, int]:
        """Skips one image (descriptor, local colour table, pixel data); the canvas grown to hold it, as PIL does."""
        left, top, width, height, flags = struct.unpack("<HHHHB", self.read(9, f"frame {k}'s descriptor"))
        self.color_table(flags, f"frame {k}'s colour table")
        self.read(1, f"frame {k}'s data")
        self.sub_blocks(f"frame {k}'s data")
        return max(canvas[0], left + width), max(canvas[1], top + height)

    def color_table(self, flags: int, what: str) -> None:
        if flags & 0x80:
            self.read(3 << ((flags & 7) + 1), what)

    def sub_blocks(self, what: str) -> None:
        while length := self.read(1, what)[0]:
            if self.handle.seek(length, os.SEEK_CUR) > self.size:
                raise self.refuse(f"it ends inside {what} (truncated)")


__all__ = ["GIF_SIGNATURES", "gif_canvases", "is_gif"]
