"""A request against a recipe, resolved with the recipe's defaults and checked before any work."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError, field_validator

from .base import (
    MAX_PROMPTS,
    MAX_REFERENCES,
    MAX_STEPS,
    SEED_MAX,
    SEED_MIN,
    Fps,
    Frames,
    MaskBlur,
    Seed,
    SequenceLength,
    Size,
    SpecModel,
    Steps,
    Unit,
)
from .errors import Problem, SpecError, SpecTypeError, from_validation_error
from .images import ImageCondition, image_condition, mask_condition, pixel_size
from .pipeline import PipelineSpec
from .recipe import IMAGE_TASKS, VIDEO_TASKS
from .references import Reference, reference_key
from .references import references as read_references
from .schedule import ScheduleSpec
from .videos import VideoCondition, holds_mask_frames, video_condition


def _number(value: Any) -> Any:
    """A request number is a number: ``True`` or ``"8"`` is a caller's mistake, not 1 or 8."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    return value


Number = BeforeValidator(_number)


class Request(SpecModel):
    """A resolved request (``Pipeline.request``); its fields carry the limits of README's "Limits and errors"."""

    prompts: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    seeds: list[Seed]
    negative_prompt: str = ""
    height: Annotated[Size, Number] | None = None
    width: Annotated[Size, Number] | None = None
    frames: Annotated[Frames, Number] | None = None
    fps: Annotated[Fps, Number] | None = None
    steps: Annotated[Steps, Number]
    # diffusers' ``sigmas=``: the walk that takes the request's steps starts from these (shifted as its schedule
    # says), one step each.
    sigmas: list[Annotated[Unit, Number]] | None = Field(default=None, min_length=1, max_length=MAX_STEPS)
    guidance_scale: Annotated[float, Number] | None = None
    max_sequence_length: Annotated[SequenceLength, Number] | None = None
    strength: Annotated[Unit, Number] | None = None
    images: list[ImageCondition] = Field(default_factory=list)
    # A video the output follows (video-to-video: a control video, e.g. poses or depth, or a video to repaint).
    video: VideoCondition | None = None
    # Inpainting: white (>= 0.5 after diffusers' binarisation) is repainted, black kept; ``mask_blur`` blurs it first.
    # With a video: one image for every frame, or a mask per frame (a ``VideoCondition`` of greyscale frames).
    mask: ImageCondition | VideoCondition | None = None
    mask_blur: Annotated[MaskBlur, Number] | None = None
    # What the output should show or sound like, in the order the model reads them (``spec.references``): images
    # (Wan VACE's reference images, a subject, a style), videos with their frame rate and sound, sounds.
    references: list[Reference] = Field(default_factory=list, max_length=MAX_REFERENCES)

    @field_validator("sigmas")
    @classmethod
    def _decreasing(cls, sigmas: list[float] | None) -> list[float] | None:
        if sigmas is not None and (sigmas[-1] <= 0 or any(b >= a for a, b in zip(sigmas, sigmas[1:]))):
            raise ValueError("sigmas must decrease strictly and stay above 0 (the terminal 0 is appended)")
        return sigmas

    @property
    def condition_digests(self) -> tuple[tuple, ...]:
        """What identifies the request's images, video, mask and reference images (part of the prompt-encoding
        cache key)."""
        mask = ((self.mask.digest, -1, self.mask_blur or 0),) if self.mask is not None else ()
        video = ((self.video.digest, "video"),) if self.video is not None else ()
        references = tuple((*reference_key(c), "reference") for c in self.references)
        return tuple((c.digest, c.frame) for c in self.images) + video + mask + references


# What diffusers' pipelines take as "guidance off" (``guidance_scale > 1`` turns CFG on; Z-Image's ``> 0``): on a
# recipe without a guidance scale these are accepted as they are, a no-op the record keeps.
GUIDANCE_OFF = (0.0, 1.0)
# Request fields a caller passes by keyword (``image`` and ``conditions`` become ``images``).
_KEYWORDS = ("negative_prompt", "height", "width", "frames", "fps", "steps", "sigmas", "guidance_scale",
             "max_sequence_length", "strength", "image", "conditions", "video", "mask", "mask_blur", "references")


def resolve_request(
    spec: PipelineSpec, prompt: str | list[str], seed: int | list[int] | None = None, *, planning: bool = False,
    **fields: Any
) -> Request:
    """Fill defaults from the recipe and check the request against its constraints.

    One seed per prompt: ``seed`` as a list gives each; an int ``S`` gives prompt ``i`` seed ``S + i``;
    ``None`` uses ``runtime.seed``. ``image`` is one image (PIL, numpy, torch tensor or path) at frame 0;
    ``conditions`` a list of ``{image, frame}`` for video models that place images at frames; ``video`` a video
    (frames, an 8-bit array or a path; see ``spec.videos``), whose frame count and size are the request's unless it
    sets them; ``mask`` an inpainting mask of the image's size (PIL, numpy, torch tensor or path; white repaints),
    or with a video one such image for every frame or a mask per frame (a list, an animated file). ``planning``
    skips the image checks (a plan such as ``explain`` shows needs no image).
    """
    prompts = request_prompts(prompt)
    seeds = request_seeds(seed, len(prompts), spec.runtime.seed)

    recipe = spec.recipe
    unknown = sorted(set(fields) - set(_KEYWORDS))
    if unknown:
        raise SpecTypeError.single(f"unknown request field(s) {unknown}; known: {sorted(_KEYWORDS)}", "request")
    refused = [name for name, value in fields.items() if value is not None and name in recipe.constraints.refuse]
    if refused:
        why = f": {recipe.constraints.refuse_reason}" if recipe.constraints.refuse_reason else ""
        raise SpecError.single(f"recipe {spec.name!r} refuses request field(s) {refused}{why}", "request")
    for name in ("frames", "fps"):
        if fields.get(name) is not None and not recipe.task.endswith("video"):
            raise SpecError.single(f"{name} is for video tasks; this recipe's task is {recipe.task!r}",
                                   f"request.{name}")
    if fields.get("guidance_scale") is not None and all(p.guidance.primary is None for p in recipe.phases):
        if fields["guidance_scale"] not in GUIDANCE_OFF:
            raise SpecError.single(f"recipe {spec.name!r} has no guidance scale to set (no embedded or CFG-like "
                                   "term); 0 or 1, diffusers' values for guidance off, are accepted as they are",
                                   "request.guidance_scale")
    if fields.get("steps") is not None and fields.get("sigmas") is None and next(request_schedules(spec), None) is None:
        raise SpecError.single(f"no phase of recipe {spec.name!r} takes the request's steps (each walks its own fixed "
                               "steps or sigmas: set them in the spec, e.g. --set recipe.phases.0.schedule.steps=N)",
                               "request.steps")
    if fields.get("strength") is not None and recipe.defaults.strength is None:
        raise SpecError.single(f"recipe {spec.name!r} starts from noise, so strength has nothing to apply to",
                               "request.strength")
    images = _conditions(fields.pop("image", None), fields.pop("conditions", None))
    video = fields.pop("video", None)
    video = video_condition(video, "request.video") if video is not None else None
    mask = _mask(fields.pop("mask", None), recipe.task.endswith("video"))
    references = read_references(fields.pop("references", None))
    if fields.get("sigmas") is not None:
        fields["steps"] = _steps_of_sigmas(spec, fields.get("sigmas"), fields.get("steps"))

    defaults = recipe.defaults.model_dump()
    values: dict[str, Any] = {k: v for k, v in defaults.items() if k in Request.model_fields}
    if video is not None:  # the video's length and size, where the request does not set them
        height, width = video.size
        values.update({k: v for k, v in (("frames", len(video.frames)), ("height", height), ("width", width))
                       if fields.get(k) is None})
    values.update({k: v for k, v in fields.items() if v is not None})
    try:
        request = Request(prompts=prompts, seeds=seeds, images=images, video=video, mask=mask, references=references,
                          **values)
    except ValidationError as exc:
        raise from_validation_error(exc, values) from None

    problems = request_problems(spec, request, planning=planning)
    if video is not None:  # a length or size the video gave, which the recipe cannot take: say where it came from
        taken = {"request.frames": fields.get("frames") is None,
                 "request": fields.get("height") is None or fields.get("width") is None}
        problems = [Problem(p.path, f"{p.message} (the video's: cut or resize the video)") if taken.get(p.path) else p
                    for p in problems]
    if problems:
        raise SpecError(problems)
    return request


def _steps_of_sigmas(spec: PipelineSpec, sigmas: Any, steps: Any) -> Any:
    """The step count a request's ``sigmas`` give; refused where no walk of the recipe takes the request's steps."""
    if isinstance(sigmas, (str, bytes)) or not isinstance(sigmas, Sequence):
        raise SpecTypeError.single(f"expected a list of numbers, got {_kind(sigmas)}", "request.sigmas")
    if steps is not None and steps != len(sigmas):
        raise SpecError.single(f"{len(sigmas)} sigmas give {len(sigmas)} steps, but steps is {steps}", "request.steps")
    if next(request_schedules(spec), None) is None:
        raise SpecError.single(f"no phase of recipe {spec.name!r} takes the request's steps (each walks its own fixed "
                               "steps or sigmas), so request sigmas have nothing to replace", "request.sigmas")
    return len(sigmas)


def request_schedules(spec: PipelineSpec) -> Iterator[tuple[tuple[str, Any], ScheduleSpec]]:
    """``(where, schedule)`` of every schedule a request's steps and sigmas apply to: a phase's own, or the shared
    schedule its segment walks (once)."""
    seen: set[str] = set()
    for i, phase in enumerate(spec.recipe.phases):
        schedule = phase.schedule
        if (of := schedule.segment_of) is not None:
            if of in seen:
                continue
            seen.add(of)
            where, schedule = ("schedules", of), spec.recipe.schedules[of]
        else:
            where = ("phases", i)
        if schedule.takes_request_steps:
            yield where, schedule


def with_request_sigmas(spec: PipelineSpec, sigmas: Sequence[float]) -> PipelineSpec:
    """The spec whose request-step schedules start from ``sigmas`` (what diffusers' ``sigmas=`` does)."""
    phases, schedules = list(spec.recipe.phases), dict(spec.recipe.schedules)
    for (kind, key), schedule in request_schedules(spec):
        replaced = schedule.model_copy(update={"sigmas": list(sigmas)})
        if kind == "phases":
            phases[key] = phases[key].model_copy(update={"schedule": replaced})  # type: ignore[index]
        else:
            schedules[key] = replaced  # type: ignore[index]
    return spec.model_copy(update={"recipe": spec.recipe.model_copy(update={"phases": phases,
                                                                            "schedules": schedules})})


def request_prompts(prompt: Any) -> list[str]:
    """``prompt`` as a list: a string, or a non-empty list or tuple of at most ``MAX_PROMPTS`` strings."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, (list, tuple)):
        raise SpecTypeError.single(f"expected a string or a non-empty list of strings, got {_kind(prompt)}", "prompt")
    if not prompt:
        raise SpecError.single("expected a string or a non-empty list of strings, got an empty list", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise SpecError.single(f"{len(prompt):,} prompts, above the limit of {MAX_PROMPTS:,} for one request (give "
                               "them in several requests)", "prompt")
    for i, p in enumerate(prompt):
        if not isinstance(p, str):
            raise SpecTypeError.single(f"expected a string, got {_kind(p)}", f"prompt.{i}")
    return list(prompt)


def request_seeds(seed: Any, count: int, default: int = 0) -> list[int]:
    """One seed per prompt: ``seed`` as a list gives each; an int ``S`` gives prompt ``i`` seed ``S + i``;
    ``None`` starts at ``default``. Every seed must lie in torch's ``manual_seed`` range ``[-2**63, 2**64 - 1]``."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != count:
            raise SpecError.single(f"got {len(seed)} seeds for {count} prompts", "seed")
        seeds = [_integer(s, f"seed.{i}") for i, s in enumerate(seed)]
        where = [f"seed.{i}" for i in range(count)]
    else:
        base = default if seed is None else _integer(seed, "seed")
        seeds = [base + i for i in range(count)]
        where = ["seed"] * count
    for i, (s, at) in enumerate(zip(seeds, where)):
        if not SEED_MIN <= s <= SEED_MAX:
            of = f" (prompt {i} gets seed + {i})" if at == "seed" and i else ""
            raise SpecError.single(f"seed {s}{of} is outside [-2**63, 2**64 - 1], the range torch's manual_seed takes",
                                   at)
    return seeds


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise SpecTypeError.single(f"expected an integer, got {value!r}", where)
    try:
        return operator.index(value)  # ints and numpy integers, never floats or strings
    except TypeError:
        raise SpecTypeError.single(f"expected an integer, got {_kind(value)}", where) from None


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def request_problems(spec: PipelineSpec, request: Request, planning: bool = False) -> list[Problem]:
    """What a resolved request breaks of the recipe's constraints (and, unless ``planning``, of its task's images)."""
    recipe = spec.recipe
    problems = [Problem("request", m) for m in recipe.constraints.size_problems(request.height, request.width)]
    problems += [Problem("request.frames", m) for m in recipe.constraints.frames_problems(request.frames)]
    cap = recipe.constraints.max_sequence_length
    if cap is not None and request.max_sequence_length is not None and request.max_sequence_length > cap:
        problems.append(Problem("request.max_sequence_length", f"{request.max_sequence_length} is above {cap}"))
    if not planning:
        problems += _image_problems(spec, request)
    return problems


def _image_problems(spec: PipelineSpec, request: Request) -> list[Problem]:
    task = spec.recipe.task
    if task in IMAGE_TASKS and not request.images:
        return [Problem("request.image", f"recipe {spec.name!r} ({task}) needs an image: pass image= (CLI: --image PATH)")]
    if task not in IMAGE_TASKS and request.images:
        return [Problem("request.image", f"recipe {spec.name!r} ({task}) takes no image")]
    problems = _video_problems(spec, request) + _mask_problems(spec, request)
    for k, condition in enumerate(request.images):
        if task.endswith("video"):
            frames = request.frames or 1
            if not -frames <= condition.frame < frames:
                problems.append(Problem(f"request.conditions.{k}.frame",
                                        f"frame {condition.frame} is outside the {frames}-frame video"))
        elif condition.frame != 0:
            problems.append(Problem(f"request.conditions.{k}.frame", f"an image task places images at frame 0, "
                                                                      f"not {condition.frame}"))
    return problems


def _mask(given: Any, video_task: bool) -> ImageCondition | VideoCondition | None:
    """The request's mask: one image, or in a video task a mask per frame (a list of masks, a file holding several
    frames, an 8-bit (F, H, W) array or tensor)."""
    if given is None:
        return None
    if video_task and holds_mask_frames(given, "request.mask"):
        return video_condition(given, "request.mask", mask=True)
    return mask_condition(given, "request.mask")


def _video_problems(spec: PipelineSpec, request: Request) -> list[Problem]:
    """A video-to-video recipe needs a video, of the request's frame count and size; every other recipe refuses
    one."""
    task, video = spec.recipe.task, request.video
    if video is None:
        return [Problem("request.video", f"recipe {spec.name!r} ({task}) needs a video: pass video= (CLI: --video "
                                         "PATH)")] if task in VIDEO_TASKS else []
    if task not in VIDEO_TASKS:
        return [Problem("request.video", f"recipe {spec.name!r} ({task}) takes no video (a video-to-video recipe "
                                         "does)")]
    problems = []
    if request.frames != len(video.frames):
        problems.append(Problem("request.frames", f"the video has {len(video.frames)} frames and the request asks "
                                                  f"for {request.frames}: the output follows the video frame by frame "
                                                  "(leave frames out to take the video's, or cut the video)"))
    if (request.height, request.width) != video.size:
        problems.append(Problem("request.video", f"the video is {video.size[1]}x{video.size[0]} and the output "
                                                 f"{request.width}x{request.height}: resize the video, or leave height "
                                                 "and width out to take the video's"))
    return problems


def _mask_problems(spec: PipelineSpec, request: Request) -> list[Problem]:
    """An inpainting recipe needs a mask of its image's size; a video-to-video recipe may take one of its video's
    size (one image or one per frame); every other recipe refuses one."""
    task, mask = spec.recipe.task, request.mask
    if task in VIDEO_TASKS:
        return _video_mask_problems(request)
    if mask is None:
        if task == "inpainting":
            return [Problem("request.mask", f"recipe {spec.name!r} (inpainting) needs a mask: pass mask= (CLI: --mask "
                                            "PATH), white where to repaint, black where to keep")]
        if request.mask_blur is not None:
            return [Problem("request.mask_blur", "mask_blur blurs a mask, and the request has none")]
        return []
    if task != "inpainting" and request.references and task.endswith("video"):
        return _reference_mask_problems(request)
    if task != "inpainting":
        return [Problem("request.mask", f"recipe {spec.name!r} ({task}) takes no mask (an inpainting or a "
                                        "video-to-video recipe does, or a video recipe with references whose family "
                                        "weighs its attention to them by one)")]
    problems = []
    if request.images:
        image, held = pixel_size(request.images[0].image), pixel_size(mask.image)
        if image != held:
            problems.append(Problem("request.mask", f"the mask is {held[1]}x{held[0]} and the image {image[1]}x"
                                                    f"{image[0]}: a mask marks the image's own pixels, so it must "
                                                    "have the image's size"))
    if request.mask_blur and not hasattr(mask.image, "filter"):
        problems.append(Problem("request.mask_blur", "mask_blur blurs an image mask (a file, a PIL image or an "
                                                     "8-bit array) with diffusers' Gaussian blur; blur a float array "
                                                     "or tensor yourself"))
    return problems


def _reference_mask_problems(request: Request) -> list[Problem]:
    """A mask with a video's references weighs the attention between the video and each reference's pixels (the
    family says whether it reads one); its values are used as given, so nothing blurs it."""
    if request.mask_blur is not None:
        return [Problem("request.mask_blur", "mask_blur is for inpainting masks: a mask over the references is used "
                                             "as given")]
    return []


def _video_mask_problems(request: Request) -> list[Problem]:
    mask, video = request.mask, request.video
    problems = []
    if request.mask_blur is not None:
        problems.append(Problem("request.mask_blur", "mask_blur is for inpainting masks: a video's mask is used as "
                                                     "given (as diffusers' video pipelines use it)"))
    if mask is None or video is None:
        return problems
    held = mask.size if isinstance(mask, VideoCondition) else pixel_size(mask.image)
    if held != video.size:
        problems.append(Problem("request.mask", f"the mask is {held[1]}x{held[0]} and the video {video.size[1]}x"
                                                f"{video.size[0]}: a mask marks the video's own pixels, so it must "
                                                "have the video's size"))
    if isinstance(mask, VideoCondition) and len(mask.frames) != len(video.frames):
        problems.append(Problem("request.mask", f"{len(mask.frames)} mask frames for a video of {len(video.frames)}: "
                                                "one mask per frame, or one image for every frame"))
    return problems


def _conditions(image: Any, conditions: Sequence[Any] | None) -> list[ImageCondition]:
    if image is not None and conditions is not None:
        raise SpecError.single("give either image (one image at frame 0) or conditions ({image, frame} list), "
                               "not both", "request.image")
    if image is not None:
        return [image_condition(image, 0, "request.image")]
    if conditions is not None and not isinstance(conditions, (list, tuple)):
        raise SpecTypeError.single(f"conditions is a list of {{image, frame}}, got {_kind(conditions)}",
                                   "request.conditions")
    out = []
    for k, item in enumerate(conditions or ()):
        where = f"request.conditions.{k}"
        if isinstance(item, Mapping):
            extra = sorted(set(item) - {"image", "frame"})
            if extra or "image" not in item:
                raise SpecError.single(f"a condition is {{image, frame}}, got keys {sorted(item)}", where)
            frame = item.get("frame", 0)
            item = item["image"]
        else:
            frame = 0
        if isinstance(frame, bool) or not isinstance(frame, int):
            raise SpecError.single(f"frame must be an integer, got {frame!r}", f"{where}.frame")
        out.append(image_condition(item, frame, where))
    return out


def request_fields(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """The scalar request fields present (not None) in a mapping such as parsed CLI options (images are
    passed as ``image``/``conditions`` by the caller)."""
    return {k: v for k, v in mapping.items()
            if k in _KEYWORDS and k not in ("image", "conditions", "references") and v is not None}
