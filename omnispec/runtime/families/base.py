"""The family protocol: the only place that knows a model's quirks.

A family encodes prompts, prepares latents (shape, packing), calls its denoiser on a batch of
passes, and decodes. It reuses the diffusers pipeline's own helpers by holding an instance of that
pipeline built from the already-loaded components (construction loads nothing), so prompt
encoding, packing and VAE normalisation equal diffusers' by construction. What a technique needs from
the denoiser is data in ``targets`` (``omnispec.targets``), not methods here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...spec import PipelineSpec, SpecError
from ...spec.base import MAX_SIZE
from ...spec.images import pixel_size
from ...spec.request import Request
from ...targets import Targets
from .checks import CheckpointMatch, Inputs, check_inputs, model_index_problems, spec_problems
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams


class Family:
    """Base class of family adapters; subclasses set ``name`` and ``pipeline_class`` and fill the hooks.

    In groups: identity (``name``, ``pipeline_class``, ``required``, ``options``, ``checkpoints``: the checkpoints it
    runs); layout (``streams``, ``spatial_streams``, ``prediction_space``, ``row_perturbations``,
    ``ragged_passes_apart``, ``flow_map``); inputs (``inputs``: what a request may hand it); what each technique needs
    from the denoiser (``targets``: ``omnispec.targets``); the checks before any weight loads (``check_spec``,
    ``check_request``, ``index_problems``: the shared ones of ``checks``, which a family may extend); the helper
    pipeline (``make_helper``, ``helper_components``); and the run hooks (encode, latents, predict, conditioning,
    decode). Every hook works on ``Streams``; a single-stream family reads and returns its one stream, ``latents``.
    """

    # ---- identity -------------------------------------------------------------------------------------
    name: ClassVar[str]
    pipeline_class: ClassVar[type | None] = None
    # Which component names the helper pipeline expects, with the role each must have.
    required: ClassVar[Mapping[str, str]] = {}
    # ``model.options`` this family reads, with their defaults.
    options: ClassVar[Mapping[str, Any]] = {}
    # How a checkpoint is recognised as one this family runs (its pipelines, model_index settings, partitions).
    checkpoints: ClassVar[CheckpointMatch] = CheckpointMatch()

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
    # What a request may hand the family besides its prompts (images, references, a mask, a video).
    inputs: ClassVar[Inputs] = Inputs()

    # ---- what techniques need from the denoiser -----------------------------------------------------------
    # Declared on the class (known before weights load); an instance's ``targets`` adds what needs the instance (its
    # modulation embeddings, bound when it is built). ``Targets.family`` is the class's name.
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
        targets = type(self).targets
        if targets.modulation is not None:
            targets = replace(targets, modulation=replace(targets.modulation, embeddings=self.modulation_embeddings))
        self.targets = targets  # type: ignore[misc]

    # ---- checks before any weight loads (``checks``: what every family checks; an override calls super()) -----

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        if problems := spec_problems(cls, spec):
            raise SpecError.single("; ".join(problems), "model.family")

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        """Refuse what this family cannot condition on, or cannot run here for ``spec``, before any work (the CLI
        asks before any weight loads)."""
        check_inputs(cls, request, spec)

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(where, why) for each setting of the checkpoint's ``model_index.json`` that this family, or this spec on
        it, would run otherwise than diffusers runs it (checked before loading)."""
        return model_index_problems(cls, index)

    # ---- the helper pipeline ------------------------------------------------------------------------------

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
