"""The family protocol: the only place that knows a model's quirks.

A family encodes prompts, prepares latents (shape, packing), calls its denoiser on a batch of
passes, and decodes. It reuses the diffusers pipeline's own helpers by holding an instance of that
pipeline built from the already-loaded components (construction loads nothing), so prompt
encoding, packing and VAE normalisation equal diffusers' by construction. What a technique needs from
the denoiser is data in ``targets`` (``omnispec.targets``), not methods here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from diffusers.utils.torch_utils import randn_tensor

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...spec.base import MAX_SIZE
from ...spec.guidance import term_of
from ...spec.images import pixel_size
from ...spec.recipe import VIDEO_TASKS
from ...spec.references import reference_kind
from ...spec.request import Request
from ...targets import Targets, TensorPlan
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams


def model_tensor_plan(denoiser: torch.nn.Module) -> TensorPlan | None:
    """The model class's own diffusers tensor-parallel plan, for models whose processors take the head count from
    the split tensors (FLUX, Qwen-Image)."""
    own = bridge.model_tensor_plan(denoiser)
    return TensorPlan(own) if own else None


class Family:
    """Base class of family adapters; subclasses set ``name`` and ``pipeline_class`` and fill the hooks.

    In groups: identity (``name``, ``pipeline_class``, ``required``, ``options``); layout (``streams``,
    ``spatial_streams``, ``prediction_space``, ``row_perturbations``, ``ragged_passes_apart``, ``flow_map``); inputs
    (``max_images``, ``max_references``, ``inpaints``, ``takes_video``, ``model_index_values``); what each technique
    needs from the denoiser (``targets``: ``omnispec.targets``); the checks before any weight loads; and the run
    hooks (encode, latents, predict, conditioning, decode). Every hook works on ``Streams``; a single-stream family
    reads and returns its one stream, ``latents``.
    """

    # ---- identity -------------------------------------------------------------------------------------
    name: ClassVar[str]
    pipeline_class: ClassVar[type | None] = None
    # Which component names the helper pipeline expects, with the role each must have.
    required: ClassVar[Mapping[str, str]] = {}
    # ``model.options`` this family reads, with their defaults.
    options: ClassVar[Mapping[str, Any]] = {}

    # ---- layout -----------------------------------------------------------------------------------------
    # The latent streams this family denoises, in the order noise is drawn and decoded; the first is primary.
    streams: ClassVar[tuple[str, ...]] = ("latents",)
    # Streams a phase transform (latent upsample, resize) rescales; the others pass through unchanged.
    spatial_streams: ClassVar[tuple[str, ...]] = ("latents",)
    # What guidance combines: the passes' velocities, or their clean-sample estimates ``x0 = x - sigma * v``
    # (LTX-2 combines and rescales x0 estimates, then steps the velocity they imply).
    prediction_space: ClassVar[str] = "velocity"
    # Perturbation kinds the denoiser applies to chosen rows of a batch, so their passes share a forward with the
    # unperturbed ones; ``predict`` then gets a list with one perturbation (or None) per row.
    row_perturbations: ClassVar[tuple[str, ...]] = ()
    # Whether passes whose prompt encodings differ in length (``ragged``: a negative prompt shorter than the prompt)
    # run as separate forwards, each at its own length with no mask, instead of one forward padded to the longest
    # with a mask. A mask moves attention off its fastest kernels (flash, cuDNN), which costs more than the batch
    # saves on a GPU; the family's diffusers pipeline runs them apart too.
    ragged_passes_apart: ClassVar[bool] = False
    # Whether the denoiser is a flow map: a model distilled to jump from one noise level to a chosen later one, so
    # besides the timestep a step starts from it takes the one the step lands on. ``predict`` then gets ``target``:
    # the next step's timestep in the same units (0 after the last), for every forward, replays included.
    flow_map: ClassVar[bool] = False

    # ---- inputs -----------------------------------------------------------------------------------------
    # How many request images the family conditions on (0: text only), and how many reference images.
    max_images: ClassVar[int] = 0
    max_references: ClassVar[int] = 0
    # Which kinds of reference it takes (``spec.references``: image, video, audio).
    reference_kinds: ClassVar[tuple[str, ...]] = ("image",)
    # Whether the family inpaints (reads the request's mask): it runs the task ``inpainting`` and only that one.
    inpaints: ClassVar[bool] = False
    # Whether the family follows a request's video (and its mask): the task ``video-to-video``.
    takes_video: ClassVar[bool] = False
    # Whether the family reads a mask given with its references (on a video task other than video-to-video) as the
    # weight of the attention between the video and the references' pixels (LTX-2.5's IC-LoRA).
    masks_references: ClassVar[bool] = False
    # Settings of the checkpoint's model_index.json this family runs as diffusers runs them, with the values it
    # accepts (Wan2.2 TI2V's expand_timesteps: a timestep per token); another value is refused before loading.
    model_index_values: ClassVar[Mapping[str, tuple[Any, ...]]] = {}
    # Components of the checkpoint that another family runs (one checkpoint, one partition per workflow), each with
    # what it is: ``omnispec init`` leaves them out of its draft, and a phase may not denoise with one.
    foreign_components: ClassVar[Mapping[str, str]] = {}
    # Scheduler classes besides FlowMatchEulerDiscreteScheduler whose schedule a ``flow_match`` schedule with the
    # config's ``shift`` reproduces, so ``omnispec init`` drafts one (``shift: from_checkpoint``) for them.
    flow_match_schedulers: ClassVar[tuple[str, ...]] = ()

    # ---- what techniques need from the denoiser -----------------------------------------------------------
    # Declared on the class (known before weights load); an instance's ``targets`` adds what needs the instance
    # (``bind_targets``). ``Targets.family`` is the class's name.
    targets: ClassVar[Targets] = Targets()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls) and cls.targets.family != cls.name:  # a refusal names the family it is about
            cls.targets = replace(cls.targets, family=cls.name)

    def __init__(self, spec: PipelineSpec, components: dict[str, Any], device: torch.device):
        self.spec = spec
        self.components = components
        self.device = device
        self.settings = {**self.options, **spec.model.options}
        self.helper = self.make_helper(components) if self.pipeline_class is not None else None
        self.targets = self.bind_targets()  # type: ignore[misc]

    def bind_targets(self) -> Targets:
        """The class's targets with what needs this instance: the modulation target's embeddings."""
        targets = type(self).targets
        if targets.modulation is not None:
            targets = replace(targets, modulation=replace(targets.modulation, embeddings=self.modulation_embeddings))
        return targets

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
                refusal = term_of(term).refusal(term, cls.targets)
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
            noun = "reference image(s)" if cls.reference_kinds == ("image",) else "reference(s)"
            raise SpecError.single(f"family {cls.name!r} takes {takes} {noun}, got "
                                   f"{len(request.references)}", "request.references")
        for k, reference in enumerate(request.references):
            if (kind := reference_kind(reference)) not in cls.reference_kinds:
                raise SpecError.single(f"family {cls.name!r} takes {' and '.join(cls.reference_kinds)} references, "
                                       f"not a {kind}", f"request.references.{k}")
        if (request.mask is not None and request.references and not cls.masks_references
                and spec.recipe.task not in ("inpainting", *VIDEO_TASKS)):
            raise SpecError.single(f"family {cls.name!r} reads no mask with its references (a mask over references "
                                   "weighs an IC-LoRA's attention to them: ltx2.5-ic-lora)", "request.mask")

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
        target: torch.Tensor | None = None,
    ) -> Streams:
        """The denoiser's prediction for a batch of rows (passes x samples). ``perturbation`` applies to every
        row, or (for kinds in ``row_perturbations``) is a list with one entry per row. ``target``: the timestep the
        step lands on, given to ``flow_map`` families only."""
        raise NotImplementedError

    def modulation_embeddings(self, denoiser: torch.nn.Module, timesteps: Sequence[torch.Tensor],
                              embedded: Sequence[float | None], cond: Conditioning) -> torch.Tensor:
        """The output of the modulation target's ``embedder`` for every (step, row) pair, step-major: one row per row
        of ``cond`` at each step, where step ``k`` has timestep ``timesteps[k]`` (as ``predict`` gets it) and embedded
        guidance ``embedded[k]``; ``predict``'s forwards compute the same embedding for their rows, one step at a
        time."""
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

    def stream_sigmas(self, sigmas: torch.Tensor) -> dict[str, torch.Tensor]:
        """Streams that walk noise levels of their own while the walk walks ``sigmas`` (float32, terminal
        included): stream -> its sigma at each of those steps (MiniMax-H3's audio, on its own shift). The steppers
        step those streams on them; by default every stream walks the walk's sigmas."""
        return {}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        raise NotImplementedError

    # Spatial view of a stream for phase transforms (identity unless the family packs it).
    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return latents

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return spatial

    def latent_dtype(self, denoiser: torch.nn.Module) -> torch.dtype:
        return denoiser.dtype
