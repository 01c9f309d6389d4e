"""The family protocol: the only place that knows a model's quirks.

A family encodes prompts, prepares latents (shape, packing), calls its denoiser on a batch of
passes, and decodes. It reuses the diffusers pipeline's own helpers by holding an instance of that
pipeline built from the already-loaded components (construction loads nothing), so prompt
encoding, packing and VAE normalisation equal diffusers' by construction.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ... import bridge
from ...spec import Modality, PipelineSpec, SkipLayer, SpecError
from ...spec.base import MAX_SIZE
from ...spec.guidance import term_of
from ...spec.images import pixel_size
from ...spec.request import Request

# The state a phase denoises: named latent streams (``latents`` for image and video models; ``video`` and
# ``audio`` for LTX-2), each with its own shape and packing, batch first.
Streams = dict[str, torch.Tensor]


def cat_streams(parts: Sequence[Mapping[str, torch.Tensor]]) -> Streams:
    return {name: torch.cat([p[name] for p in parts]) if len(parts) > 1 else parts[0][name] for name in parts[0]}


def batch_of(streams: Mapping[str, torch.Tensor]) -> int:
    return next(iter(streams.values())).shape[0]


@dataclass
class Conditioning:
    """What a pass conditions on besides the latents: encoded prompts and, for image-conditioned families,
    the encoded images. ``batched`` tensors have one row per sample; ``shared`` ones serve every sample.
    ``ragged`` names batched entries whose length (dim 1) may differ between conditionings (prompt encodings
    padded to their own call's longest prompt): ``cat`` zero-pads them to the longest, so their masks, listed
    too, mark the padding 0."""

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    ragged: frozenset[str] = frozenset()

    @property
    def batch_size(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def rows(self, index: torch.Tensor | slice | Sequence[int]) -> Conditioning:
        """These rows of every batched entry (an entry may live on the host, e.g. lengths a family reads every
        step without a device sync: a tensor index goes to each entry's own device)."""
        if isinstance(index, torch.Tensor):
            return Conditioning({k: v[index.to(v.device)] for k, v in self.batched.items()}, self.shared, self.ragged)
        return Conditioning({k: v[index] for k, v in self.batched.items()}, self.shared, self.ragged)

    def with_(self, other: Conditioning | None) -> Conditioning:
        """This conditioning plus ``other``'s entries (image conditioning joined to prompt encodings)."""
        if other is None:
            return self
        return Conditioning({**self.batched, **other.batched}, {**self.shared, **other.shared},
                            self.ragged | other.ragged)

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        if len(parts) == 1:
            return parts[0]
        ragged = parts[0].ragged
        return Conditioning({k: torch.cat(_padded([p.batched[k] for p in parts]) if k in ragged else
                                          [p.batched[k] for p in parts]) for k in parts[0].batched},
                            parts[0].shared, ragged)


def _padded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero-pad each tensor's dim 1 to the longest's."""
    n = max(t.shape[1] for t in tensors)
    return [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, n - t.shape[1])) for t in tensors]


@dataclass
class Geometry:
    """Pixel size of a phase's output and anything a family needs to (un)pack its latents; ``extra`` holds
    what a family derives once per phase (position ids, masks) so steps don't rebuild it."""

    height: int
    width: int
    frames: int | None = None
    fps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decoded:
    """A decoded output: ``array`` float32 in [0, 1], channels last, batch first; ``audio`` (B, channels,
    samples) float32 at ``sample_rate`` for families with a sound track."""

    array: np.ndarray
    audio: np.ndarray | None = None
    sample_rate: int | None = None


Perturbation = Union[SkipLayer, Modality]



@dataclass(frozen=True)
class TensorPlan:
    """A denoiser's tensor-parallel plan: ``linears`` in diffusers' ``_tp_plan`` format (``{glob: "colwise" |
    "rowwise" | packed marker}``, one ``*`` over a block list); ``heads``: fnmatch patterns of attention modules
    whose processor reads ``attn.heads`` (divided by the degree, each rank keeping its heads); ``norms``: patterns
    of RMSNorms over all heads at once (each rank normalises its slice with the sum of squares summed over ranks);
    ``rope``: attention modules handed rotary tables that span all heads (``query_rotary_emb``/``key_rotary_emb``:
    4-D split tables cut on the head axis, interleaved ones on the feature axis), cut to this rank's heads."""

    linears: Mapping[str, Any]
    heads: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    rope: tuple[str, ...] = ()

class Family:
    """Base class of family adapters; subclasses set ``name`` and ``pipeline_class`` and fill the hooks.

    Every hook works on ``Streams``; a single-stream family reads and returns its one stream, ``latents``.
    """

    name: ClassVar[str]
    pipeline_class: ClassVar[type | None] = None
    # The latent streams this family denoises, in the order noise is drawn and decoded; the first is primary.
    streams: ClassVar[tuple[str, ...]] = ("latents",)
    # Streams a phase transform (latent upsample, resize) rescales; the others pass through unchanged.
    spatial_streams: ClassVar[tuple[str, ...]] = ("latents",)
    # Block lists that policies (offload, compile, cache, layer skip) may address, in forward order.
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # Attention roles of this family's denoiser: role -> fnmatch patterns of attention module names.
    attention_roles: ClassVar[Mapping[str, tuple[str, ...]]] = {"self": ("*attn*",)}
    # Role -> category (``self``, ``cross``): a role not named in ``policies.attention.per_role`` takes its
    # category's entry there, then the default.
    attention_categories: ClassVar[Mapping[str, str]] = {}
    # Which component names the helper pipeline expects, with the role each must have.
    required: ClassVar[Mapping[str, str]] = {}
    # Modalities a ``modality`` guidance term may isolate (switch off the cross-attention into).
    modalities: ClassVar[tuple[str, ...]] = ()
    # How many request images the family conditions on (0: text only), and how many reference images.
    max_images: ClassVar[int] = 0
    max_references: ClassVar[int] = 0
    # Perturbation kinds the denoiser applies to chosen rows of a batch, so their passes share a forward with the
    # unperturbed ones; ``predict`` then gets a list with one perturbation (or None) per row.
    row_perturbations: ClassVar[tuple[str, ...]] = ()
    # Whether passes whose prompt encodings differ in length (``ragged``: a negative prompt shorter than the prompt)
    # run as separate forwards, each at its own length with no mask, instead of one forward padded to the longest
    # with a mask. A mask moves attention off its fastest kernels (flash, cuDNN), which costs more than the batch
    # saves on a GPU; the family's diffusers pipeline runs them apart too.
    ragged_passes_apart: ClassVar[bool] = False
    # Settings of the checkpoint's model_index.json this family runs as diffusers runs them, with the values it
    # accepts (Wan2.2 TI2V's expand_timesteps: a timestep per token); another value is refused before loading.
    model_index_values: ClassVar[Mapping[str, tuple[Any, ...]]] = {}
    # What guidance combines: the passes' velocities, or their clean-sample estimates ``x0 = x - sigma * v``
    # (LTX-2 combines and rescales x0 estimates, then steps the velocity they imply).
    prediction_space: ClassVar[str] = "velocity"
    # Whether the denoiser has a diffusers context-parallel plan for ulysses / ring, and if not,
    # why sequence parallelism is refused.
    context_parallel: ClassVar[bool] = False
    context_parallel_refusal: ClassVar[str] = "no context-parallel plan for ulysses/ring"
    # Why ``policies.parallel.tensor`` is refused on this family, or None when ``tensor_plan`` gives a plan.
    tensor_parallel_refusal: ClassVar[str | None] = "no tensor-parallel plan is written for its denoiser"
    # Cache kinds this family's denoiser cannot take, with the reason (checked before loading).
    cache_limits: ClassVar[Mapping[str, str]] = {}
    # The attention processor ``policies.attention.fused_qk_norm_rope`` gives each of the denoiser's attentions,
    # built from the processor it replaces and the fused operator the policy hands over (None from it: that
    # attention keeps its processor; None here: the family has none, and the field is refused).
    qk_norm_rope_processor: ClassVar[Callable[[Any, Callable[..., Any]], Any] | None] = None
    # The (block, hook) pairs ``policies.mlp.fused_gelu`` registers for the denoiser's parallel blocks (attention and
    # MLP side by side, projected back together), given the denoiser and the fused operators the policy hands over
    # (``policies.mlp.MlpOperators``); None: the family has no such blocks.
    parallel_mlp_hooks: ClassVar[Callable[[Any, Any], list[tuple[Any, Any]]] | None] = None
    # Modules of the denoiser called once per forward whose outputs every block reads (the rotary embedding, the
    # timestep embedding, the text states the cross-attentions read): under regional CUDA graphs they are kept in
    # static storage (``compile.KeptBlockInputs``) instead of being copied into every block's graph before each replay.
    shared_block_inputs: ClassVar[tuple[str, ...]] = ()
    # ``policies.mlp.precomputed_modulation``: the denoiser's module whose output is the embedding every modulation
    # linear reads (each through a SiLU), and fnmatch patterns of those linears' names; ``modulation_embeddings``
    # computes that embedding for every step ahead. None: the family has none, and the field is refused.
    modulation_embedder: ClassVar[str | None] = None
    modulation_linears: ClassVar[tuple[str, ...]] = ()
    # Why ``skip_layer`` guidance terms cannot run on this family's denoiser, or None when they can.
    skip_layer_refusal: ClassVar[str | None] = None
    # ``model.options`` this family reads, with their defaults.
    options: ClassVar[Mapping[str, Any]] = {}
    # Whether the family inpaints (reads the request's mask): it runs the task ``inpainting`` and only that one.
    inpaints: ClassVar[bool] = False
    # Whether the family follows a request's video (and its mask): the task ``video-to-video``.
    takes_video: ClassVar[bool] = False

    @classmethod
    def tensor_plan(cls, denoiser: torch.nn.Module) -> TensorPlan | None:
        """How ``denoiser``'s linears split over tensor-parallel ranks (None: they don't). By default the model
        class's own diffusers plan, for models whose processors take the head count from the split tensors."""
        own = bridge.model_tensor_plan(denoiser)
        return TensorPlan(own) if own else None

    def __init__(self, spec: PipelineSpec, components: dict[str, Any], device: torch.device):
        self.spec = spec
        self.components = components
        self.device = device
        self.settings = {**self.options, **spec.model.options}
        self.helper = self.make_helper(components) if self.pipeline_class is not None else None

    # ---- checks before any weight loads -------------------------------------------------------------

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        comps = spec.model.components
        problems = []
        for name, role in cls.required.items():
            if name not in comps:
                problems.append(f"family {cls.name!r} needs a component named {name!r} (role {role})")
            elif comps[name].role != role:
                problems.append(f"family {cls.name!r} needs {name!r} to have role {role!r}")
        for phase in spec.recipe.phases:
            for term in phase.guidance.terms:
                refusal = term_of(term).refusal(term, cls)
                if refusal:
                    problems.append(f"{refusal} (phase {phase.name!r})")
            unknown = sorted(phase.guidance.streams - set(cls.streams))
            if unknown:
                problems.append(f"phase {phase.name!r} scales streams {unknown}; family {cls.name!r} has "
                                f"{', '.join(cls.streams)}")
        if cls.inpaints != (spec.recipe.task == "inpainting"):
            problems.append(f"family {cls.name!r} runs the task inpainting only (it needs the request's mask)"
                            if cls.inpaints else f"family {cls.name!r} does not inpaint: it would ignore the mask of "
                            "an inpainting task (an inpainting family does: omnispec list)")
        if spec.recipe.task == "video-to-video" and not cls.takes_video:
            problems.append(f"family {cls.name!r} takes no video: it would ignore the video of a video-to-video task "
                            "(omnispec list shows the families that take one)")
        unknown_options = sorted(set(spec.model.options) - set(cls.options))
        if unknown_options:
            have = ", ".join(cls.options) or "none"
            problems.append(f"family {cls.name!r} has no option(s) {unknown_options} (options: {have})")
        if problems:
            raise SpecError.single("; ".join(problems), "model.family")

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        """Refuse what this family cannot condition on, or cannot run here for ``spec``, before any work (the CLI
        asks before any weight loads)."""
        if len(request.images) > cls.max_images:
            raise SpecError.single(f"family {cls.name!r} conditions on at most {cls.max_images} image(s), got "
                                   f"{len(request.images)}", "request.image")
        if len(request.references) > cls.max_references:
            takes = f"at most {cls.max_references}" if cls.max_references else "no"
            raise SpecError.single(f"family {cls.name!r} takes {takes} reference image(s), got "
                                   f"{len(request.references)}", "request.references")

    @classmethod
    def checkpoint_pipelines(cls) -> tuple[str, ...]:
        """The pipeline classes a checkpoint's ``model_index.json`` names for the models this family runs (what
        ``omnispec init`` matches): its helper pipeline's by default."""
        return (cls.pipeline_class.__name__,) if cls.pipeline_class is not None else ()

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(where, why) for each setting of the checkpoint's ``model_index.json`` that this family, or this spec on
        it, would run otherwise than diffusers runs it (checked before loading; ``model_index_values`` here)."""
        problems = []
        for key, accepted in cls.model_index_values.items():
            if index.get(key) not in accepted:
                problems.append(("model.family", (
                    f"the checkpoint's model_index.json has {key}: {json.dumps(index.get(key))}, which family "
                    f"{cls.name!r} does not run (it runs {key} {' or '.join(json.dumps(a) for a in accepted)}): "
                    "another variant of the model, which another family runs (omnispec list)")))
        return problems

    def make_helper(self, components: dict[str, Any]) -> Any:
        assert self.pipeline_class is not None
        kwargs = {name: components.get(name) for name in self.helper_components()}
        return self.pipeline_class(**kwargs)

    def helper_components(self) -> Sequence[str]:
        return tuple(self.required)

    # ---- the protocol --------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Prompt encodings, one row per prompt (the runtime caches them per prompts and images)."""
        raise NotImplementedError

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The request's size at ``size_scale``; without one, the first conditioning image's (floored to the
        recipe's ``size_multiple_of``), as an image-to-image user expects (diffusers would take its default)."""
        height, width = request.height, request.width
        if (not height or not width) and request.images:
            height, width = self.image_size(request.images[0].image)
        h = int(round(height * size_scale)) if height else 0
        w = int(round(width * size_scale)) if width else 0
        return Geometry(h, w, request.frames, request.fps)

    def image_size(self, image: Any) -> tuple[int, int]:
        """(height, width) of a conditioning image (PIL, (H, W, C) array or (C, H, W) tensor), floored to the
        recipe's size multiple and kept within its bounds."""
        height, width = pixel_size(image)
        constraints = self.spec.recipe.constraints
        m = constraints.size_multiple_of
        low, high = -(-constraints.min_size // m) * m, (constraints.max_size or MAX_SIZE) // m * m
        return min(max(low, height // m * m), high), min(max(low, width // m * m), high)

    def tokens(self, geometry: Geometry) -> int:
        """Image tokens per sample of the primary stream (dynamic shift, rows per forward, sequence split)."""
        raise NotImplementedError

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Pure noise in the denoiser's layout, one generator per sample (as diffusers' ``randn_tensor``)."""
        raise NotImplementedError

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The request's images as the denoiser takes them at this phase's size, one row per sample; joined to
        every pass's prompt conditioning. Called after the phase's starting latents are drawn."""
        return None

    def image_latents(self, request: Request, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """The request's image as latents to re-noise (phase input kind ``image``: image-to-image)."""
        raise SpecError.single(f"family {self.name!r} cannot start from an image", "recipe.phases.0.input")

    def predict(
        self,
        denoiser: torch.nn.Module,
        latents: Streams,
        timestep: torch.Tensor,
        cond: Conditioning,
        geometry: Geometry,
        *,
        embedded: float | None = None,
        perturbation: Perturbation | Sequence[Perturbation | None] | None = None,
    ) -> Streams:
        """The denoiser's prediction for a batch of rows (passes x samples). ``perturbation`` applies to every
        row, or (for kinds in ``row_perturbations``) is a list with one entry per row."""
        raise NotImplementedError

    def modulation_embeddings(self, denoiser: torch.nn.Module, timesteps: Sequence[torch.Tensor],
                              embedded: Sequence[float | None], cond: Conditioning) -> torch.Tensor:
        """The output of ``modulation_embedder`` for every (step, row) pair, step-major: one row per row of ``cond``
        at each step, where step ``k`` has timestep ``timesteps[k]`` (as ``predict`` gets it) and embedded guidance
        ``embedded[k]``; ``predict``'s forwards compute the same embedding for their rows, one step at a time."""
        raise NotImplementedError

    def constrain(self, guided: Streams, latents: Streams, images: Conditioning | None, geometry: Geometry) -> Streams:
        """Impose conditioning on the guided prediction (in ``prediction_space``) before the step: LTX-2's image
        conditions fix the clean-sample estimate on their tokens."""
        return guided

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Fresh noise shaped like ``latents``, drawn per sample in the layout diffusers draws it (re-noising)."""
        return {name: randn_tensor(tuple(x.shape), generator=generators, device=x.device, dtype=x.dtype)
                for name, x in latents.items()}

    def start(self, latents: Streams, images: Conditioning | None, geometry: Geometry, sigma: float) -> Streams:
        """A walk's first state, at noise level ``sigma``, with its conditioning in place (LTX-2 mixes the clean
        image tokens into the noise by their mask); by default the same as ``reimpose``."""
        return self.reimpose(latents, images, geometry, sigma)

    def reimpose(self, latents: Streams, images: Conditioning | None, geometry: Geometry, sigma: float) -> Streams:
        """Put conditioning back into a state at noise level ``sigma`` (after a step, or a stored state before one)
        where the model needs it: first-frame latents of image-to-video, the kept region of inpainting (re-noised
        to ``sigma``)."""
        return latents

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        raise NotImplementedError

    # Spatial view of a stream for phase transforms (identity unless the family packs it).
    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return latents

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return spatial

    def latent_dtype(self, denoiser: torch.nn.Module) -> torch.dtype:
        return denoiser.dtype

    # ---- shared helpers -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def layer_skip(self, denoiser: torch.nn.Module, skip: Perturbation | None) -> Iterator[None]:
        """Apply a skip-layer perturbation with diffusers' layer-skip hooks for one forward, then remove it."""
        if skip is None:
            yield
            return
        if not isinstance(skip, SkipLayer):
            raise SpecError.single(f"family {self.name!r} cannot run a {skip.kind} perturbation", "guidance")
        from diffusers.hooks import LayerSkipConfig

        config = LayerSkipConfig(
            indices=list(skip.layers),
            fqn=skip.blocks or self.block_lists[0],
            skip_attention=skip.skip in ("block", "attention"),
            skip_attention_scores=skip.skip == "attention_scores",
            skip_ff=skip.skip in ("block", "ff"),
        )
        hook_name = "omnispec_layer_skip"
        bridge.apply_layer_skip_hook(denoiser, config, hook_name)
        try:
            yield
        finally:
            blocks = denoiser.get_submodule(config.fqn)
            for i in config.indices:
                for module in blocks[i].modules():
                    bridge.remove_hook(module, hook_name)


class PackedLatents:
    """Mixin for families that pack 2x2 latent patches into tokens (FLUX, Qwen-Image, Z-Image): the latent grid
    (even on both sides, as their pipelines round it) and the token count the schedule's shift reads."""

    helper: Any

    def _latent_hw(self, geometry: Geometry) -> tuple[int, int]:
        f = self.helper.vae_scale_factor
        return 2 * (geometry.height // (f * 2)), 2 * (geometry.width // (f * 2))

    def tokens(self, geometry: Geometry) -> int:
        h, w = self._latent_hw(geometry)
        return (h // 2) * (w // 2)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU: a CUDA tensor copied into page-locked memory, anything else as ``t.cpu()`` does. A copy
    into ordinary host memory goes through the driver's staging buffer and faults in every new page: on an H200 a
    rollout's 540 MB of images and states took 360 ms that way. Page-locked blocks come from torch's caching host
    allocator, which keeps each for the next result of its size once the last array over it is gone (until then
    it stays reserved, rounded up to a power of two)."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)  # synchronous: the values are there on return, as with .cpu()
    return out


def decode_images(helper: Any, decoded: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1] (B, C, H, W) -> float32 (B, H, W, C) in [0, 1]: diffusers' postprocess denormalizes
    (``output_type="pt"``, on the tensor's device), then the layout and float32 conversion its ``"np"`` output would
    make on the host run where the tensor is (the same values: a widening cast is exact), so the host only copies."""
    images = helper.image_processor.postprocess(decoded, output_type="pt")
    return to_host(images.permute(0, 2, 3, 1).float()).numpy()
