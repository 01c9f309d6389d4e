"""Kandinsky 6 video super-resolution (``Kandinsky6SRPipeline``): a video in, the same video 2, 2.25 or 4 times
larger out, refined tile by tile by a text-free transformer.

The input (the request's video) is cut into overlapping tiles, each at the trained tile size whose aspect is
nearest the video's divided by the upscale; every tile's K-VAE latents are upscaled (by the checkpoint's latent
upscaler bank, or as pixels, bilinearly, before encoding), mixed variance-preservingly with noise
(``sqrt(1 - s^2) * lq + s * noise``, ``s`` the option ``lq_noise_scale``) and denoised from the schedule's first
step; the decoded tiles are blended under Hann windows. 2.25x upscales the pixels 1.125x (bilinear, to the VAE's
grid) and then runs the 2x path.

One stream, ``latents`` (B, T, F, h, w, C): T tiles per sample in the transformer's own layout and dtype. Noise is
drawn per sample, ``tiles_batch_size`` tiles at a time in tile order, as the pipeline draws it; the prompt is not
read (the transformer takes no text: one prompt per sample, any text). The released checkpoint is PiFlow-distilled
(``PiflowScheduler``, ``n_grid`` outputs per channel): only schedule kind ``scheduler`` steps it, and stochastic
samplers need an undistilled transformer, as for ``kandinsky6``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import Kandinsky6SRPipeline
from diffusers.utils.torch_utils import randn_tensor

from ...spec import PipelineSpec, SpecError
from ...spec.errors import Problem
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .kandinsky6 import other_kandinsky6_pipeline, piflow_grid
from .types import Conditioning, Decoded, Geometry, Streams

SCALES = (2, 2.25, 4)
UNREGISTERED = "diffusers' block hooks do not know Kandinsky 6 SR's blocks (they are not in its TransformerBlockRegistry)"
NABLA = ("its NABLA sparse attention is a flex-attention BlockMask that the transformer always sends to flex "
         "attention: no other backend can take it")
TILES = "kandinsky6_sr_tiles"  # geometry.extra: the tile plan


@dataclass(frozen=True)
class TilePlan:
    """Where the tiles lie. ``size``: the input's (height, width) after the 2.25x pre-upscale; ``scale``: the
    tiling upscale (2 or 4); ``base``: the trained tile size each tile is refined at; ``tile``: a tile's size in the
    input (``base / scale``); ``starts``: each tile's (top, left) in the input, row by row."""

    size: tuple[int, int]
    pre_upscale: float
    scale: int
    base: tuple[int, int]
    tile: tuple[int, int]
    starts: tuple[tuple[int, int], ...]

    @property
    def output(self) -> tuple[int, int]:
        return self.size[0] * self.scale, self.size[1] * self.scale


def tile_starts(length: int, tile: int, min_overlap: float, snap: int) -> list[int]:
    """Starts of tiles of ``tile`` pixels covering ``length``, first at 0 and last at ``length - tile``, spread
    evenly on the ``snap`` grid so that neighbours share at least ``min_overlap * tile``."""
    if length <= tile:
        return [0]
    room = (length - tile) // snap
    stride = max(1, math.floor(tile * (1 - min_overlap) / snap))
    gaps = -(-room // stride)
    return [round(k * room / gaps) * snap for k in range(gaps + 1)]


def hann_window(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Outer product of two Hann windows two samples longer than the tile, ends cut, so no weight is zero."""
    rows = torch.hann_window(height + 2, device=device)[1:-1]
    cols = torch.hann_window(width + 2, device=device)[1:-1]
    return rows[:, None] * cols[None, :]


class Kandinsky6SRFamily(Family):
    name = "kandinsky6_sr"
    pipeline_class = Kandinsky6SRPipeline
    inputs = Inputs(takes_video=True)
    options = {"resolution_scale": 2.25, "lq_noise_scale": 0.7, "min_overlap": 0.2, "tiles_batch_size": 1}
    targets = Targets(
        attention=AttentionTarget({}),
        blocks=BlocksTarget(("visual_transformer_blocks",), shared_inputs=("visual_rope_embeddings",)),
        parallel=ParallelTarget(sequence_refusal="Kandinsky6SRTransformer3DModel has no diffusers context-parallel "
                                                 "plan"),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED,
                      "taylorseer": "diffusers' TaylorSeer cache hooks the attentions its patterns name; Kandinsky 6 "
                                    "SR's sit under visual_transformer_blocks, so it would cache nothing"},
    )
    required = {"vae": "vae"}

    # ---- checks before any weight loads ---------------------------------------------------------------

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        problems = cls._option_problems(spec.model.options)
        for i, phase in enumerate(spec.recipe.phases):
            if phase.guidance.terms or phase.guidance.embedded is not None:
                problems.append(Problem(f"recipe.phases.{i}.guidance", "the SR transformer takes no text and no "
                                                                       "guidance input: it runs one pass a step"))
        if spec.policies.attention.default != "auto":
            problems.append(Problem("policies.attention.default", f"family {cls.name!r} runs attention one way only: "
                                                                  f"{NABLA}"))
        if problems:
            raise SpecError(problems)

    @staticmethod
    def _option_problems(options) -> list[Problem]:
        checks = {
            "resolution_scale": (lambda v: v in SCALES, "2, 2.25 or 4 (the checkpoint's trained scales)"),
            "lq_noise_scale": (lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "a number in (0, 1]"),
            "min_overlap": (lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "a number in [0, 1)"),
            "tiles_batch_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                                 "a positive integer"),
        }
        return [Problem(f"model.options.{key}", f"{options[key]!r} is not {expected}")
                for key, (valid, expected) in checks.items() if key in options and not valid(options[key])]

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index) -> list[tuple[str, str]]:
        return [*super().index_problems(spec, index), *other_kandinsky6_pipeline(cls.name, index)]

    def __init__(self, spec: PipelineSpec, components, device: torch.device):
        super().__init__(spec, components, device)
        config = self.helper.transformer.config
        self.grid = piflow_grid(config, spec)

    def helper_components(self):
        return ("transformer", "vae", "scheduler", "latent_upscaler")

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.transformer.dtype  # the pipeline keeps the tiles in the transformer's dtype

    # ---- prompts -----------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Nothing the transformer reads: one empty row per prompt (a prompt only counts a sample)."""
        return Conditioning({"samples": torch.zeros((len(prompts), 0), device=self.device)})

    # ---- geometry and tiles ------------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The output's size: the request's (the video's) after the pre-upscale, times the tiling scale."""
        plan = self.tile_plan(request.height or 0, request.width or 0)
        geometry = Geometry(*plan.output, request.frames, request.fps or 24)
        geometry.extra[TILES] = plan
        return geometry

    def tile_plan(self, height: int, width: int) -> TilePlan:
        helper, settings = self.helper, self.settings
        snap, scale = helper.vae_scale_factor_spatial, settings["resolution_scale"]
        scale_of_tiles, pre = (2, 1.125) if scale == 2.25 else (int(scale), 1.0)
        if pre != 1.0:
            height, width = round(height * pre / snap) * snap, round(width * pre / snap) * snap
        base = min(helper.transformer_tile_sizes, key=lambda hw: abs(hw[1] / hw[0] - width / height))
        if base[0] % (snap * scale_of_tiles) or base[1] % (snap * scale_of_tiles):
            raise SpecError.single(f"the checkpoint's tile size {base[0]}x{base[1]} is not a multiple of the VAE's "
                                   f"{snap} px times the upscale {scale_of_tiles}, so its tiles miss the latent grid",
                                   "model.options.resolution_scale")
        tile = (base[0] // scale_of_tiles, base[1] // scale_of_tiles)
        if height < tile[0] or width < tile[1]:
            raise SpecError.single(f"at resolution_scale {scale} the video must be at least {tile[1]}x{tile[0]} "
                                   f"(one tile), got {width}x{height}", "request.video")
        overlap = settings["min_overlap"]
        tops, lefts = tile_starts(height, tile[0], overlap, snap), tile_starts(width, tile[1], overlap, snap)
        return TilePlan((height, width), pre, scale_of_tiles, base, tile,
                        tuple((top, left) for top in tops for left in lefts))

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int, int]:
        """(tiles, frames, height, width) of one sample's latents."""
        plan, helper = geometry.extra[TILES], self.helper
        snap = helper.vae_scale_factor_spatial
        frames = ((geometry.frames or 1) - 1) // helper.vae_scale_factor_temporal + 1
        return len(plan.starts), frames, plan.base[0] // snap, plan.base[1] // snap

    def tokens(self, geometry: Geometry) -> int:
        tiles, f, h, w = self.latent_shape(geometry)
        pt, ph, pw = self.helper.transformer.config.patch_size
        return tiles * (f // pt) * (h // ph) * (w // pw)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Each sample's noise, ``tiles_batch_size`` tiles a draw in tile order, from its own generator."""
        tiles, f, h, w = self.latent_shape(geometry)
        channels, dtype = self.helper.transformer.config.in_visual_dim, self.latent_dtype(None)
        chunk = self.settings["tiles_batch_size"]
        samples = [torch.cat([randn_tensor((min(chunk, tiles - start), f, h, w, channels), generator=g,
                                           device=self.device, dtype=dtype) for start in range(0, tiles, chunk)])
                   for g in generators]
        return {"latents": torch.stack(samples)}

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The video's tiles as the denoiser starts from them (B, T, F, h, w, C), the same for every sample."""
        if request.video is None:
            return None
        helper, plan = self.helper, geometry.extra[TILES]
        video = helper.video_processor.preprocess_video(list(request.video.frames)).to(self.device)
        if plan.pre_upscale != 1.0:
            video = _resize_frames(video, plan.size)
        tiles = self._upscaled_tiles(video, plan)
        tiles = tiles.permute(0, 1, 3, 4, 5, 2).to(self.latent_dtype(None))
        return Conditioning({"lq_tiles": tiles.expand(len(generators), *tiles.shape[1:])})

    def _upscaled_tiles(self, video: torch.Tensor, plan: TilePlan) -> torch.Tensor:
        """(1, T, C, F, h, w) scaled K-VAE latents of each tile at the trained tile size."""
        helper, snap = self.helper, self.helper.vae_scale_factor_spatial
        (th, tw), bank = plan.tile, helper.latent_upscaler
        if bank is not None and plan.scale in bank.config.scales:
            latents = helper.encode_video(video)
            tiles = [bank(latents[..., top // snap:(top + th) // snap, left // snap:(left + tw) // snap],
                          scale=plan.scale, return_dict=False)[0] for top, left in plan.starts]
        else:
            tiles = [helper.encode_video(_resize_frames(video[..., top:top + th, left:left + tw], plan.base))
                     for top, left in plan.starts]
        return torch.stack(tiles, dim=1)

    def start(self, latents: Streams, images: Conditioning | None, geometry: Geometry, sigma: float) -> Streams:
        """The noise mixed, variance-preservingly, into the low-resolution tiles."""
        assert images is not None, "a video-to-video request carries its video"
        s = self.settings["lq_noise_scale"]
        lq = images.batched["lq_tiles"]
        return {"latents": math.sqrt(1 - s**2) * lq + s * latents["latents"]}

    # ---- the denoiser -------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None, perturbation=None,
                ) -> Streams:
        """Every tile of every row, ``tiles_batch_size`` tiles a forward; the input channels are ``[latent | anchor
        latent | anchor mask]``, the anchor zero as in the released (anchor-free) checkpoints."""
        x = latents["latents"].to(self.latent_dtype(denoiser))
        rows, tiles = x.shape[:2]
        flat = x.flatten(0, 1)
        chunk = self.settings["tiles_batch_size"]
        outs = []
        for part in flat.split(chunk):
            mask = torch.zeros((*part.shape[:-1], 1), dtype=part.dtype, device=part.device)
            model_input = torch.cat([part, torch.zeros_like(part), mask], dim=-1)
            outs.append(denoiser(hidden_states=model_input, timestep=timestep.expand(part.shape[0]),
                                 return_dict=False)[0])
        return {"latents": torch.cat(outs).unflatten(0, (rows, tiles))}

    # ---- decode -----------------------------------------------------------------------------------------

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Each tile decoded (``tiles_batch_size`` at a time) and blended into the output under its Hann window."""
        helper, plan = self.helper, geometry.extra[TILES]
        x = latents["latents"]
        out_h, out_w = plan.output
        bh, bw = plan.base
        window = hann_window(bh, bw, self.device)
        weight = torch.zeros((out_h, out_w), device=self.device)
        places = [(top * plan.scale, left * plan.scale) for top, left in plan.starts]
        for top, left in places:
            weight[top:top + bh, left:left + bw] += window
        videos = []
        chunk = self.settings["tiles_batch_size"]
        for sample in x:
            canvas = None
            for start in range(0, len(places), chunk):
                decoded = helper.decode_latents(sample[start:start + chunk].permute(0, 4, 1, 2, 3))
                if canvas is None:
                    canvas = torch.zeros((3, decoded.shape[2], out_h, out_w), device=self.device)
                for tile, (top, left) in zip(decoded, places[start:start + chunk]):
                    canvas[:, :, top:top + bh, left:left + bw] += tile * window
            videos.append(canvas)
        video = (torch.stack(videos) / weight).clamp(-1, 1)
        frames = helper.video_processor.postprocess_video(video, output_type="np")
        return Decoded(np.asarray(frames, dtype=np.float32))


def _resize_frames(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, C, F, H, W) frames resized to ``size`` bilinearly (no corner alignment), frame by frame."""
    b, _, f = video.shape[:3]
    frames = F.interpolate(video.permute(0, 2, 1, 3, 4).flatten(0, 1), size=size, mode="bilinear",
                           align_corners=False)
    return frames.unflatten(0, (b, f)).permute(0, 2, 1, 3, 4)
