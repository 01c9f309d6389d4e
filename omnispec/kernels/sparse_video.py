"""Sparse attention over a video's (frames, height, width) token grid on torch's FlexAttention.

The tokens are put in tile-major order (each tile of ``tile`` tokens contiguous, tiles in raster order) so that the
block mask's 128-token blocks hold whole tiles and whole blocks are skipped; the output is put back in the
denoiser's order. Two layouts (``policies.attention.sparse``): ``sliding_tile``, each query tile seeing the key
tiles within ``window`` tiles along each axis; ``radial``, whole frames within ``window[0]`` tiles in time and,
farther, a spatial reach that halves as the temporal distance doubles. FlexAttention computes only the blocks the
mask keeps, and applies the mask inside partial blocks, so a layout is exact attention over the kept pairs.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# FlexAttention's block of tokens, and the query rows whose mask a block mask's making holds at once (times every key:
# at Wan2.1 14B 480p's 32,760 tokens 0.5 GB an integer intermediate).
BLOCK = 128
QUERIES_AT_ONCE = 16 * BLOCK


@dataclass(frozen=True)
class VideoLayout:
    """One sparse layout of one token grid: ``order`` puts the denoiser's tokens in tile-major order, ``restore``
    puts them back, ``mask`` is the block mask over the tile-major sequence."""

    tokens: int
    order: torch.Tensor
    restore: torch.Tensor
    mask: BlockMask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Attention of (batch, heads, tokens, head_dim) queries, keys and values under the layout."""
        q, k, v = (x.index_select(-2, self.order) for x in (q, k, v))
        # inside compiled code (a compiled block the redirect is traced into) the compiler takes flex_attention as
        # its operator and, under inductor, makes its fused kernel; elsewhere ``_flex`` decides
        flex = flex_attention if torch.compiler.is_compiling() else _flex(q.device.type)
        out = flex(q, k, v, block_mask=self.mask, scale=scale)
        return out.index_select(-2, self.restore)


def tile_ids(grid: tuple[int, int, int], tile: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile-major order of a raster grid's tokens, and each ordered token's tile coordinates (tokens, 3)."""
    f, h, w = grid
    coords = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)
    tiles = coords // torch.tensor(tile)
    inner = coords % torch.tensor(tile)
    extent = torch.tensor(grid)
    tile_counts = (extent + torch.tensor(tile) - 1) // torch.tensor(tile)
    key = ((tiles[:, 0] * tile_counts[1] + tiles[:, 1]) * tile_counts[2] + tiles[:, 2]) * (
        int(torch.tensor(tile).prod())) + (inner[:, 0] * tile[1] + inner[:, 1]) * tile[2] + inner[:, 2]
    order = torch.argsort(key)
    return order, tiles[order]


def radial_reach(tile_extent: int, least: int, near: int, distances: int) -> torch.Tensor:
    """Spatial reach in tiles at each temporal distance 0..distances-1: the whole extent up to ``near`` tiles away,
    then halved at each doubling of the distance, never under ``least``."""
    reach = []
    for d in range(distances):
        if d <= near:
            reach.append(tile_extent)
            continue
        doublings = (d // (near + 1)).bit_length()  # once just past near, again at each doubling of d / (near + 1)
        reach.append(max(least, tile_extent >> doublings))
    return torch.tensor(reach)


def layout(kind: str, grid: tuple[int, int, int], tile: tuple[int, int, int], window: tuple[int, int, int],
           device: torch.device) -> VideoLayout:
    """The layout of ``kind`` over ``grid`` (built once per grid and settings: ``cached_layout``)."""
    order, tiles = tile_ids(grid, tile)
    tf, th, tw = (tiles[:, i].to(device) for i in range(3))
    if kind == "sliding_tile":
        wf, wh, ww = window

        def keep(b, h, q, kv):
            return ((tf[q] - tf[kv]).abs() <= wf) & ((th[q] - th[kv]).abs() <= wh) & ((tw[q] - tw[kv]).abs() <= ww)
    elif kind == "radial":
        counts = [(g + t - 1) // t for g, t in zip(grid, tile)]
        reach_h = radial_reach(counts[1], window[1], window[0], counts[0]).to(device)
        reach_w = radial_reach(counts[2], window[2], window[0], counts[0]).to(device)

        def keep(b, h, q, kv):
            d = (tf[q] - tf[kv]).abs()
            return ((th[q] - th[kv]).abs() <= reach_h[d]) & ((tw[q] - tw[kv]).abs() <= reach_w[d])
    else:
        raise ValueError(f"unknown sparse layout {kind!r}")
    n = order.numel()
    order = order.to(device)
    return VideoLayout(n, order, torch.argsort(order), block_mask(keep, n, device))


def block_mask(keep, tokens: int, device: torch.device, block: int = BLOCK) -> BlockMask:
    """The FlexAttention block mask of ``keep`` (a mask_mod) over ``tokens`` queries and keys, as
    ``create_block_mask`` makes it (partial and full blocks apart), computed ``QUERIES_AT_ONCE`` query rows at a time.
    Why not ``create_block_mask`` itself: uncompiled, it evaluates the mask_mod over every (query, key) pair at once,
    and the layouts' integer intermediates then take 8.6 GB each at Wan2.1 14B 480p's 32,760 tokens (tens of GB
    together, beside the model); compiled, it costs a compile per grid."""
    blocks = -(-tokens // block)
    keys = torch.arange(tokens, device=device)
    partial, full = [], []
    for start in range(0, blocks * block, QUERIES_AT_ONCE):
        queries = torch.arange(start, min(start + QUERIES_AT_ONCE, blocks * block), device=device)
        kept = keep(0, 0, queries.clamp_max(tokens - 1)[:, None], keys[None, :]) & (queries < tokens)[:, None]
        kept = F.pad(kept, (0, blocks * block - tokens)).view(-1, block, blocks, block)
        count = kept.sum(dim=(1, 3), dtype=torch.int32)
        partial.append((count > 0) & (count < block * block))
        full.append(count == block * block)
    ordered = [_ordered(torch.cat(rows)[None, None]) for rows in (partial, full)]
    return BlockMask.from_kv_blocks(*ordered[0], *ordered[1], BLOCK_SIZE=block, mask_mod=keep,
                                    seq_lengths=(tokens, tokens))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query block's number of kept key blocks and their indices first (then the rest), as BlockMask holds
    them."""
    dense = dense.to(torch.int32)
    return dense.sum(dim=-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
        torch.int32)


@functools.lru_cache(maxsize=16)
def cached_layout(kind: str, grid: tuple[int, int, int], tile: tuple[int, int, int], window: tuple[int, int, int],
                  device: str) -> VideoLayout:
    return layout(kind, grid, tile, window, torch.device(device))


def kept_fraction(video: VideoLayout) -> float:
    """The fraction of the (query, key) blocks the layout computes (1.0: dense)."""
    total = video.mask.kv_num_blocks.new_tensor(video.mask.kv_num_blocks.shape[-1] ** 2)
    kept = video.mask.kv_num_blocks.sum() + (video.mask.full_kv_num_blocks.sum()
                                             if video.mask.full_kv_num_blocks is not None else 0)
    return float(kept / total)


@functools.cache
def _flex(device_type: str):
    """FlexAttention compiled on CUDA (its fused kernel; eager flex computes the dense scores), eager elsewhere,
    where compiling a kernel per grid would cost more than it saves (torch's warning about the eager path is about
    GPUs, so it is kept from the user's terminal there)."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
            return flex_attention(*args, **kwargs)

    return eager
