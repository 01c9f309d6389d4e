"""``policies.vae``: diffusers' own tiled and sliced decode, switched on for every VAE component that has them
(``enable_tiling`` with the spec's tiles passed as each class takes them, ``enable_slicing``); and a decode that
runs out of device memory over several samples tried once more sliced (``decode_in_memory``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..log import logger
from ..spec import PipelineSpec, SpecError

T = TypeVar("T")


def apply_vae(spec: PipelineSpec, components: dict[str, Any]) -> str | None:
    """Switch tiling/slicing on; returns what explain shows (None when the policy asks for nothing). A VAE that
    cannot tile (LTX-2's audio VAE, the digits VAE) decodes whole beside one that can; if none can, the spec is
    refused."""
    policy = spec.policies.vae
    if policy.tiling is False and not policy.slicing:
        return None
    vaes = _vaes(spec, components)
    notes = []
    if policy.tiling is not False:
        tiled = {n: v for n, v in vaes.items() if hasattr(v, "use_tiling") and hasattr(v, "enable_tiling")}
        if not tiled:
            raise SpecError.single(f"no VAE here tiles ({_classes(vaes)}: diffusers gives them no tiled decode)",
                                   "policies.vae.tiling")
        for name, vae in tiled.items():
            notes.append(f"{name} tiled ({enable_tiling(vae, policy.tiling, name)})")
        notes += [f"{name} decodes whole (no tiled decode in {type(v).__name__})" for name, v in vaes.items()
                  if name not in tiled]
    if policy.slicing:
        sliced = {n: v for n, v in vaes.items() if hasattr(v, "enable_slicing")}
        if not sliced:
            raise SpecError.single(f"no VAE here decodes in slices ({_classes(vaes)})", "policies.vae.slicing")
        for name, vae in sliced.items():
            vae.enable_slicing()
            notes.append(f"{name} sliced (one sample at a time)")
    return "; ".join(notes)


def decode_in_memory(spec: PipelineSpec, components: dict[str, Any], decode: Callable[[], T], samples: int) -> T:
    """``decode()``; where it runs out of device memory over more than one sample while some VAE decodes the batch
    whole, once more with those VAEs sliced (one sample at a time, diffusers' ``enable_slicing``), then as they were.
    A rollout of 16 videos then finishes instead of failing at its last step; each sample's pixels are its own
    decode's, up to the last bits a convolution's batch size can change."""
    try:
        return decode()
    except torch.OutOfMemoryError:
        whole = [v for v in _vaes(spec, components).values()
                 if hasattr(v, "enable_slicing") and getattr(v, "use_slicing", None) is False]
        if samples < 2 or not whole:
            raise
    # past the handler, so that the failed decode's tensors went with its traceback
    logger.warning(f"decoding {samples} samples at once ran out of device memory: decoding them one at a time "
                   "(set policies.vae.slicing: true to start so)")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for vae in whole:
        vae.enable_slicing()
    try:
        return decode()
    finally:
        for vae in whole:
            vae.disable_slicing()


def _vaes(spec: PipelineSpec, components: dict[str, Any]) -> dict[str, torch.nn.Module]:
    return {n: components[n] for n, c in spec.model.components.items() if c.role == "vae"
            and isinstance(components.get(n), torch.nn.Module)}


def _classes(vaes: dict[str, Any]) -> str:
    return ", ".join(f"{n}: {type(v).__name__}" for n, v in vaes.items()) or "no VAE component"


def enable_tiling(vae: torch.nn.Module, tiles: Any, name: str) -> str:
    """Tiling on ``vae``: its defaults for ``True``, else ``tiles.tile`` / ``tiles.overlap`` pixels in the form its
    class takes them (the video VAEs' keyword sizes and strides; AutoencoderKL's tile attributes, which its
    ``enable_tiling`` does not take)."""
    if tiles is True:
        vae.enable_tiling()
        return "its default tiles"
    ratio = int(getattr(vae, "spatial_compression_ratio", 0) or 2 ** (len(vae.config.block_out_channels) - 1))
    if tiles.tile % ratio or tiles.overlap % ratio:
        raise SpecError.single(f"{name} downsamples by {ratio}: tile {tiles.tile} and overlap {tiles.overlap} "
                               f"must be multiples of {ratio}", "policies.vae.tiling")
    takes = set(inspect.signature(vae.enable_tiling).parameters)
    given = {
        "tile_sample_min_height": tiles.tile, "tile_sample_min_width": tiles.tile,
        "tile_sample_stride_height": tiles.tile - tiles.overlap, "tile_sample_stride_width": tiles.tile - tiles.overlap,
        "tile_latent_min_height": tiles.tile // ratio, "tile_latent_min_width": tiles.tile // ratio,
        "tile_overlap_factor": tiles.overlap / tiles.tile,
    }
    vae.enable_tiling(**{k: v for k, v in given.items() if k in takes})
    if not takes & set(given):  # AutoencoderKL: the sizes are attributes
        vae.tile_sample_min_size = tiles.tile
        vae.tile_latent_min_size = tiles.tile // ratio
        vae.tile_overlap_factor = tiles.overlap / tiles.tile
    return f"{tiles.tile} px tiles overlapping {tiles.overlap} px"
