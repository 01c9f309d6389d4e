"""Tiny Kandinsky 6 super-resolution checkpoints (``Kandinsky6SRPipeline``: a video refined tile by tile).

The release's modules at toy widths: the causal K-VAE compressing 4x in space (three levels) and 4x in time, a
bank of x2 and x4 latent upscalers, and the text-free SR transformer whose trained tile sizes are 32x32, 32x64 and
64x32 pixels (an 8x8 token grid per tile, the least NABLA's 8x8 attention blocks take). ``distilled`` gives the
released layout: a ``PiflowScheduler`` and a transformer predicting ``n_grid`` values per latent channel; otherwise
a flow-matching Euler scheduler and plain velocities. ``upscaler=False`` leaves the bank out (the pipeline then
upscales pixel tiles bilinearly and encodes them).
"""

from __future__ import annotations

from pathlib import Path

from .fixtures import _seeded

N_GRID = 2  # the distilled scheduler's predictions per channel
LATENT_CHANNELS = 4
TILE_SIZES = ((32, 32), (32, 64), (64, 32))


def kandinsky6_sr_components(seed: int = 0, distilled: bool = True, upscaler: bool = True) -> dict:
    """Tiny ``Kandinsky6SRPipeline`` modules."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

    _seeded(seed)
    transformer = Kandinsky6SRTransformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS * (N_GRID if distilled else 1), time_dim=16,
        model_dim=16, ff_dim=32, num_visual_blocks=2, axes_dims=(2, 2, 4), nabla_window=(3, 3, 3),
        tile_sizes=TILE_SIZES).eval()
    _seeded(seed)
    vae = Kandinsky6SRVAE(latent_channels=LATENT_CHANNELS, encoder_block_out_channels=(8, 8, 8),
                          decoder_block_out_channels=(8, 8, 8), layers_per_block=1, temporal_compression_start_level=0
                          ).eval()
    bank = None
    if upscaler:
        _seeded(seed)
        bank = Kandinsky6SRLatentUpscalerBank(in_channels=LATENT_CHANNELS, stage_channels=(8, 8, 8), num_pre_blocks=1,
                                              num_mid_blocks=1, num_post_blocks=1, num_x2_adapter_blocks=1).eval()
    scheduler = PiflowScheduler(shift=5.0, n_grid=N_GRID) if distilled else FlowMatchEulerDiscreteScheduler(shift=5.0)
    return dict(transformer=transformer, vae=vae, scheduler=scheduler, latent_upscaler=bank)


def tiny_kandinsky6_sr(root: str | Path, seed: int = 0, distilled: bool = True, upscaler: bool = True) -> Path:
    """``Kandinsky6SRPipeline`` layout."""
    from diffusers import Kandinsky6SRPipeline

    Kandinsky6SRPipeline(**kandinsky6_sr_components(seed, distilled, upscaler)).save_pretrained(root)
    return Path(root)


__all__ = ["kandinsky6_sr_components", "tiny_kandinsky6_sr"]
