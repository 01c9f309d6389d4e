"""The recipe: request defaults and constraints, the phases that turn a request into latents, the output."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from .base import (
    MAX_FRAMES,
    MAX_SEQUENCE_LENGTH,
    MAX_SIZE,
    MAX_STEPS,
    Fps,
    Frames,
    SequenceLength,
    Size,
    SpecModel,
    Steps,
    Unit,
)
from .guidance import GUIDANCE, GuidanceSpec
from .kinds import Kinds
from .schedule import SCHEDULES, SHARED_SCHEDULES, Schedule, SharedSchedule

Task = Literal["text-to-image", "text-to-video", "image-to-video", "image-to-image", "inpainting", "video-to-video"]
RequestField = Literal[
    "negative_prompt", "height", "width", "frames", "fps", "steps", "sigmas", "guidance_scale", "max_sequence_length",
    "strength", "mask_blur",
]
# Tasks whose requests must carry an image; the text-to-X tasks refuse one. Inpainting also needs a mask, which
# every other task refuses.
IMAGE_TASKS = ("image-to-video", "image-to-image", "inpainting")
# Tasks whose requests must carry a video (and may carry a mask of it); every other task refuses one.
VIDEO_TASKS = ("video-to-video",)


class RequestDefaults(SpecModel):
    """Values a request gets when it does not set them (a closed set: every field here is a request field)."""

    height: Size | None = None
    width: Size | None = None
    frames: Frames | None = None
    fps: Fps | None = None
    steps: Steps = 28
    max_sequence_length: SequenceLength | None = None
    negative_prompt: str = ""
    strength: Unit | None = Field(default=None, description=(
        "How far an image input is re-noised (image-to-image): 1 starts from noise, 0 returns the image. "
        "Needed by, and only by, recipes whose first phase takes input kind 'image'."))


class Constraints(SpecModel):
    size_multiple_of: int = Field(default=8, ge=1, le=MAX_SIZE)
    min_size: Size = 16
    max_size: Size | None = None
    frames_multiple_of: int = Field(default=1, ge=1, le=MAX_FRAMES, description="frames must equal k * multiple + offset.")
    frames_offset: int = Field(default=0, ge=0, le=MAX_FRAMES)
    max_frames: Frames | None = None
    max_sequence_length: int | None = Field(default=None, ge=1, le=MAX_SEQUENCE_LENGTH,
                                            description="Upper bound for the request field.")
    refuse: list[RequestField] = Field(default_factory=list, description="Request fields this recipe rejects.")
    refuse_reason: str | None = Field(default=None, description="Why, shown when a request sets a refused field.")

    def size_problems(self, height: int | None, width: int | None) -> list[str]:
        problems = []
        for name, value in (("height", height), ("width", width)):
            if value is None:
                continue
            if value % self.size_multiple_of:
                problems.append(f"{name} {value} is not a multiple of {self.size_multiple_of}")
            if value < self.min_size:
                problems.append(f"{name} {value} is below the minimum {self.min_size}")
            if self.max_size is not None and value > self.max_size:
                problems.append(f"{name} {value} is above the maximum {self.max_size}")
        return problems

    def frames_problems(self, frames: int | None) -> list[str]:
        if frames is None:
            return []
        problems = []
        if (frames - self.frames_offset) % self.frames_multiple_of or frames < self.frames_offset:
            problems.append(
                f"frames {frames} must be k*{self.frames_multiple_of}+{self.frames_offset} (e.g. "
                f"{self.frames_multiple_of * max(1, (frames - self.frames_offset) // self.frames_multiple_of) + self.frames_offset})"
            )
        if self.max_frames is not None and frames > self.max_frames:
            problems.append(f"frames {frames} is above the maximum {self.max_frames}")
        return problems


# ---- phase inputs -----------------------------------------------------------------------------------

class LatentUpsample(SpecModel):
    """Upsample the previous phase's latents to this phase's size (its ``size_scale`` decides the factor) with an
    ``upsampler`` component, or by interpolation."""

    kind: Literal["latent_upsample"]
    upsampler: str | None = Field(default=None, description="Component with role 'upsampler'; interpolate if unset.")
    mode: Literal["nearest", "bilinear", "bicubic", "trilinear"] = "bilinear"


class Resize(SpecModel):
    """Resize the previous phase's latents to this phase's size by interpolation."""

    kind: Literal["resize"]
    mode: Literal["nearest", "bilinear", "bicubic", "trilinear"] = "bilinear"


LatentTransform = Annotated[Union[LatentUpsample, Resize], Field(discriminator="kind")]


class InitialInput(SpecModel):
    kind: Literal["initial"]


class ImageInput(SpecModel):
    """The request's image, encoded by the family and re-noised to the step where ``strength`` enters the
    schedule (diffusers' image-to-image: ``strength x steps`` of the steps run)."""

    kind: Literal["image"]


class PreviousInput(SpecModel):
    """The previous phase's latents, optionally transformed, then optionally re-noised.

    ``renoise: first`` mixes in fresh noise up to the phase schedule's first sigma; a number ``s``
    keeps only the schedule's steps with sigma <= s and re-noises to the first of them.
    """

    kind: Literal["previous"]
    transform: LatentTransform | None = None
    renoise: Unit | Literal["first"] | None = None


PhaseInput = Annotated[Union[InitialInput, ImageInput, PreviousInput], Field(discriminator="kind")]


class SamplerSpec(SpecModel):
    """Base of the samplers (``SAMPLERS``). ``stochastic``: its steps draw noise and carry a log-prob (rollouts)."""

    stochastic: ClassVar[bool] = False


class ODESampler(SamplerSpec):
    """Deterministic Euler step ``x + (sigma_next - sigma) * v`` (or the scheduler's own ``step``)."""

    kind: Literal["ode"]


class AllSteps(SpecModel):
    """Every step of the walk that runs (the last one only with the sampler's ``include_last``)."""

    kind: Literal["all"]


class FixedWindow(SpecModel):
    """Steps ``start .. start + length - 1`` are stochastic."""

    kind: Literal["fixed"]
    start: int = Field(default=0, ge=0, le=MAX_STEPS)
    length: int = Field(ge=1, le=MAX_STEPS)


class RandomWindow(SpecModel):
    """``length`` consecutive stochastic steps starting at a step drawn from ``[low, high]``, drawn once per
    rollout batch, per group or per sample (``scope``) from ``seed`` (MixGRPO-style sliding windows)."""

    kind: Literal["random"]
    length: int = Field(ge=1, le=MAX_STEPS)
    low: int = Field(default=0, ge=0, le=MAX_STEPS)
    high: int = Field(ge=0, le=MAX_STEPS)
    scope: Literal["batch", "group", "sample"] = "group"
    seed: int = 0

    @model_validator(mode="after")
    def _ordered(self) -> RandomWindow:
        if self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        return self


class SlidingWindow(SpecModel):
    """MixGRPO's sliding window (Li et al., 2025, arXiv:2507.21802): ``length`` consecutive stochastic steps, the
    same for every sample, that move over training: at the trainer's ``iteration`` the window starts at ``start +
    stride * (iteration // every)``. Past the last start where the whole window fits the usable steps, it stays
    there, or with ``wrap`` goes back to ``start`` (MixGRPO's ``roll_back``)."""

    kind: Literal["sliding"]
    length: int = Field(ge=1, le=MAX_STEPS)
    start: int = Field(default=0, ge=0, le=MAX_STEPS)
    stride: int | None = Field(default=None, ge=1, le=MAX_STEPS, description=(
        "Steps the window moves each time; default its length (MixGRPO without prog_overlap)."))
    every: int = Field(default=25, ge=1, description="Training iterations between moves (MixGRPO's iters_per_group).")
    iteration: int = Field(default=0, ge=0, description="The trainer's iteration, which places the window.")
    wrap: bool = False

    def first_step(self, last: int) -> int:
        """The window's first step at ``iteration``, given ``last``, the highest start where it still fits."""
        stride = self.stride or self.length
        moves = self.iteration // self.every
        if self.wrap:
            moves %= (max(last, self.start) - self.start) // stride + 1
        return min(self.start + stride * moves, max(last, self.start))


StochasticWindow = Annotated[Union[AllSteps, FixedWindow, RandomWindow, SlidingWindow], Field(discriminator="kind")]


class OutsideWindow(SpecModel):
    """How the deterministic steps outside the stochastic window run. They carry no log-prob and are never
    replayed, so they may be cheaper than the window's exact steps without moving a replay ratio off 1."""

    compute_every: int = Field(default=1, ge=1, le=MAX_STEPS, description=(
        "Compute the prediction on one outside step in every compute_every (the first of each run of outside "
        "steps, and of each phase, always computes) and reuse the last computed prediction on the others: "
        "an Euler step over several sigmas at once. 1 computes every step."))
    solver: Literal["euler", "dpmsolver++"] = Field(default="euler", description=(
        "The ODE steps after the window: Euler, or second-order multistep DPM-Solver++ on the clean-sample "
        "estimates of the steps so far (MixGRPO-Flash's post-window solver; its last step is first order). Steps "
        "before the window stay Euler."))
    solver_type: Literal["heun", "midpoint"] = Field(default="heun", description=(
        "DPM-Solver++'s second-order correction (MixGRPO's default: heun)."))
    compress: float = Field(default=1.0, gt=0, le=1, description=(
        "Walk the schedule after the window's last step on fewer, larger steps (MixGRPO-Flash's "
        "dpm_post_compress_ratio): of the n points after it (the terminal 0 included), max(int(n * compress), 2) "
        "remain, evenly spaced in the schedule's time before its shift and shifted as the schedule is. 1 keeps "
        "every step; the window's steps and all before them never change. Needs a flow_match schedule."))

    @model_validator(mode="after")
    def _one_speed_up(self) -> OutsideWindow:
        if self.solver != "euler" and self.compute_every != 1:
            raise ValueError("a multistep solver after the window needs every step's prediction; use compute_every: 1")
        if self.compress != 1 and self.compute_every != 1:
            raise ValueError(f"compress: {self.compress} already takes fewer steps after the window; reusing "
                             "predictions on top of it is not offered, use compute_every: 1")
        return self

    def points_after(self, points: int) -> int:
        """How many of the ``points`` sigmas after the window's last step (the terminal included) a compressed walk
        keeps: ``int(points * compress)``, at least 2 so the walk still ends at sigma 0, at most ``points``."""
        return min(points, max(int(points * self.compress), 2))


class _Stochastic(SamplerSpec):
    stochastic: ClassVar[bool] = True
    window: StochasticWindow = Field(default_factory=lambda: AllSteps(kind="all"))
    include_last: bool = Field(default=False, description=(
        "Let the window use the walk's last step. Flow-GRPO and DanceGRPO leave it out (its std is tiny and "
        "its log-prob an outlier), so by default it stays a deterministic Euler step."))
    decode: Literal["final", "x0"] = Field(default="final", description=(
        "What a rollout decodes: the final state, or the clean-sample estimate x - sigma * v of the last step "
        "(DanceGRPO). They differ only when the last step is stochastic (include_last)."))
    multistep: Literal["refuse", "euler"] = Field(default="refuse", description=(
        "On a multistep solver's schedule (Wan's UniPC): refuse it, or take every step of the window's walk as "
        "an Euler step (the window's as the SDE) on the solver's own sigmas and timesteps, as Flow-GRPO's Wan "
        "pipeline does. The deterministic steps then differ from what generation with the solver gives."))
    outside_window: OutsideWindow = Field(default_factory=OutsideWindow)


class SDESampler(_Stochastic):
    """Flow-GRPO's SDE (Liu et al., 2025, arXiv:2505.05470): ``std_t = noise_level * sqrt(sigma / (1 - sigma))``
    (sigma = 1 replaced by the schedule's second sigma), transition std ``std_t * sqrt(sigma - sigma_next)``,
    a drift corrected so the marginals match the ODE's; Gaussian log-prob."""

    kind: Literal["sde"]
    noise_level: float = Field(default=0.7, gt=0)


class CPSSampler(_Stochastic):
    """Coefficient-preserving sampling (Wang & Yu, 2025, arXiv:2509.05952): transition std ``sigma_next *
    sin(noise_level * pi / 2)``; the step keeps the noise coefficient at ``sigma_next`` exactly."""

    kind: Literal["cps"]
    noise_level: float = Field(default=0.8, gt=0, le=1)
    log_prob: Literal["squared_error", "gaussian"] = Field(default="squared_error", description=(
        "squared_error: -mean((x_next - mean)^2) with every constant removed, as Flow-GRPO and Flow-CPS score "
        "CPS steps; gaussian: the full Gaussian log-density (its log-ratio is squared_error's over 2 std^2)."))

    @model_validator(mode="after")
    def _last_step_has_no_density(self) -> CPSSampler:
        if self.include_last and self.log_prob == "gaussian":
            raise ValueError("CPS's last step has std 0 (sigma_next = 0), where a Gaussian log-prob is undefined; "
                             "use log_prob: squared_error or include_last: false")
        return self


class DanceSDESampler(_Stochastic):
    """DanceGRPO's SDE (Xue et al., 2025, arXiv:2505.07818): constant ``eta``, transition std ``eta *
    sqrt(sigma - sigma_next)``, drift ``v dt - eta^2 / 2 * score dt``; Gaussian log-prob."""

    kind: Literal["dance_sde"]
    eta: float = Field(default=0.3, gt=0)


# Each sampler's step lives with the runtime (runtime/samplers/, one file per stochastic kind).
SAMPLERS = Kinds("sampler")
SAMPLERS.register(ODESampler, "omnispec.runtime.samplers.ode:ODE")
SAMPLERS.register(SDESampler, "omnispec.runtime.samplers.sde:SDE")
SAMPLERS.register(CPSSampler, "omnispec.runtime.samplers.cps:CPS")
SAMPLERS.register(DanceSDESampler, "omnispec.runtime.samplers.dance_sde:DANCE_SDE")
Sampler = Annotated[SamplerSpec, SAMPLERS]


def stochastic_kinds() -> tuple[str, ...]:
    return tuple(kind for kind, cls in SAMPLERS.classes.items() if cls.stochastic)


class Phase(SpecModel):
    name: str = Field(min_length=1)
    denoiser: str
    schedule: Schedule
    guidance: GuidanceSpec = Field(default_factory=GuidanceSpec)
    input: PhaseInput = Field(default_factory=lambda: InitialInput(kind="initial"))
    adapter: str | None = Field(default=None, description="Adapter slot active during this phase.")
    size_scale: float = Field(default=1.0, gt=0, description="Phase resolution relative to the request's.")
    sampler: Sampler = Field(default_factory=lambda: ODESampler(kind="ode"))


class OutputSpec(SpecModel):
    phase: int | str = Field(default=-1, description="Index or name of the phase whose latents are decoded.")


class Recipe(SpecModel):
    task: Task = "text-to-image"
    defaults: RequestDefaults = Field(default_factory=RequestDefaults)
    constraints: Constraints = Field(default_factory=Constraints)
    schedules: dict[str, SharedSchedule] = Field(
        default_factory=dict, description="Schedules shared by several phases (see schedule kind 'segment')."
    )
    phases: list[Phase] = Field(min_length=1)
    output: OutputSpec = Field(default_factory=OutputSpec)

    @model_validator(mode="after")
    def _video_tasks_have_frames(self) -> Recipe:
        if self.task.endswith("video") and self.defaults.frames is None:
            raise ValueError(f"task {self.task!r} needs defaults.frames")
        return self

    def output_index(self) -> int | None:
        out = self.output.phase
        if isinstance(out, str):
            names = [p.name for p in self.phases]
            return names.index(out) if out in names else None
        n = len(self.phases)
        return out % n if -n <= out < n else None


for _kinds in (GUIDANCE, SAMPLERS, SCHEDULES):
    _kinds.held_by(Phase, Recipe)
SHARED_SCHEDULES.held_by(Recipe)
