"""A request against a recipe, resolved with the recipe's defaults and checked before any work."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from .base import SpecModel
from .errors import Problem, SpecError, from_validation_error
from .pipeline import PipelineSpec
from .recipe import IMAGE_TASKS


class ImageCondition(SpecModel):
    """An image the request conditions on, placed at ``frame`` of the output video (0 for image tasks).

    ``image`` is kept as the caller gave it (a PIL image, a numpy array or a torch tensor; a path is opened
    as diffusers' ``load_image`` opens it), so a family hands diffusers' image processor exactly what a
    diffusers user would. ``digest`` identifies the pixels (prompt-encoding cache keys, provenance).
    """

    image: Any
    frame: int = 0
    digest: str
    path: str | None = None


class Request(SpecModel):
    prompts: list[str] = Field(min_length=1)
    seeds: list[int]
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    fps: int | None = None
    steps: int = Field(ge=1)
    guidance_scale: float | None = None
    max_sequence_length: int | None = None
    strength: float | None = Field(default=None, ge=0.0, le=1.0)
    images: list[ImageCondition] = Field(default_factory=list)

    @property
    def image_digests(self) -> tuple[tuple[str, int], ...]:
        return tuple((c.digest, c.frame) for c in self.images)


# Request fields a caller passes by keyword (``image`` and ``conditions`` become ``images``).
_KEYWORDS = ("negative_prompt", "height", "width", "frames", "fps", "steps", "guidance_scale", "max_sequence_length",
             "strength", "image", "conditions")


def resolve_request(
    spec: PipelineSpec, prompt: str | list[str], seed: int | list[int] | None = None, *, planning: bool = False,
    **fields: Any
) -> Request:
    """Fill defaults from the recipe and check the request against its constraints.

    One seed per prompt: ``seed`` as a list gives each; an int ``S`` gives prompt ``i`` seed ``S + i``;
    ``None`` uses ``runtime.seed``. ``image`` is one image (PIL, numpy, torch tensor or path) at frame 0;
    ``conditions`` a list of ``{image, frame}`` for video models that place images at frames. ``planning``
    skips the image checks (a plan such as ``explain`` shows needs no image).
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise SpecError.single("prompt must be a string or a non-empty list of strings", "prompt")
    if isinstance(seed, list):
        if len(seed) != len(prompts):
            raise SpecError.single(f"got {len(seed)} seeds for {len(prompts)} prompts", "seed")
        seeds = [int(s) for s in seed]
    else:
        base = spec.runtime.seed if seed is None else int(seed)
        seeds = [base + i for i in range(len(prompts))]

    recipe = spec.recipe
    unknown = sorted(set(fields) - set(_KEYWORDS))
    if unknown:
        raise SpecError.single(f"unknown request field(s) {unknown}; known: {sorted(_KEYWORDS)}", "request")
    refused = [name for name, value in fields.items() if value is not None and name in recipe.constraints.refuse]
    if refused:
        raise SpecError.single(f"recipe {spec.name!r} refuses request field(s) {refused}", "request")
    if fields.get("frames") is not None and not recipe.task.endswith("video"):
        raise SpecError.single(f"frames is for video tasks; this recipe's task is {recipe.task!r}", "request.frames")
    if fields.get("guidance_scale") is not None and all(p.guidance.primary is None for p in recipe.phases):
        raise SpecError.single(f"recipe {spec.name!r} has no guidance scale to set (no embedded or CFG-like term)",
                               "request.guidance_scale")
    if fields.get("strength") is not None and recipe.defaults.strength is None:
        raise SpecError.single(f"recipe {spec.name!r} starts from noise, so strength has nothing to apply to",
                               "request.strength")
    images = _conditions(fields.pop("image", None), fields.pop("conditions", None))

    defaults = recipe.defaults.model_dump()
    values: dict[str, Any] = {k: v for k, v in defaults.items() if k in Request.model_fields}
    values.update({k: v for k, v in fields.items() if v is not None})
    try:
        request = Request(prompts=prompts, seeds=seeds, images=images, **values)
    except ValidationError as exc:
        raise from_validation_error(exc, values) from None

    problems = [Problem("request", m) for m in recipe.constraints.size_problems(request.height, request.width)]
    problems += [Problem("request.frames", m) for m in recipe.constraints.frames_problems(request.frames)]
    cap = recipe.constraints.max_sequence_length
    if cap is not None and request.max_sequence_length is not None and request.max_sequence_length > cap:
        problems.append(Problem("request.max_sequence_length", f"{request.max_sequence_length} is above {cap}"))
    if not planning:
        problems += _image_problems(spec, request)
    if problems:
        raise SpecError(problems)
    return request


def _image_problems(spec: PipelineSpec, request: Request) -> list[Problem]:
    task = spec.recipe.task
    if task in IMAGE_TASKS and not request.images:
        return [Problem("request.image", f"recipe {spec.name!r} ({task}) needs an image: pass image= (CLI: --image PATH)")]
    if task not in IMAGE_TASKS and request.images:
        return [Problem("request.image", f"recipe {spec.name!r} ({task}) takes no image")]
    problems = []
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


def _conditions(image: Any, conditions: Sequence[Any] | None) -> list[ImageCondition]:
    if image is not None and conditions is not None:
        raise SpecError.single("give either image (one image at frame 0) or conditions ({image, frame} list), "
                               "not both", "request.image")
    if image is not None:
        return [image_condition(image, 0, "request.image")]
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


def image_condition(image: Any, frame: int, where: str) -> ImageCondition:
    """Open a path as diffusers' ``load_image`` does (EXIF orientation applied, RGB) and fingerprint the
    pixels; PIL images, numpy arrays and torch tensors are kept as given."""
    import numpy as np
    from PIL import Image, ImageOps

    path = None
    if isinstance(image, (str, Path)):
        path = str(image)
        try:
            with Image.open(path) as opened:
                image = ImageOps.exif_transpose(opened).convert("RGB")
        except FileNotFoundError:
            raise SpecError.single(f"no such image file: {path}", where) from None
        except OSError as exc:
            raise SpecError.single(f"cannot read image {path}: {exc}", where) from None
    if isinstance(image, Image.Image):
        pixels = np.asarray(image)
    elif hasattr(image, "detach"):  # a torch tensor (torch is not imported by the spec layer)
        pixels = image.detach().cpu().float().numpy()
    elif isinstance(image, np.ndarray):
        pixels = image
    else:
        raise SpecError.single(f"an image is a PIL image, numpy array, torch tensor or path, got "
                               f"{type(image).__name__}", where)
    if pixels.ndim not in (2, 3, 4) or pixels.size == 0:
        raise SpecError.single(f"an image has 2 to 4 dimensions, got shape {pixels.shape}", where)
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(f"{pixels.shape}{pixels.dtype}".encode() + pixels.tobytes()).hexdigest()[:32]
    return ImageCondition(image=image, frame=frame, digest=digest, path=path)


def request_fields(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """The scalar request fields present (not None) in a mapping such as parsed CLI options (images are
    passed as ``image``/``conditions`` by the caller)."""
    return {k: v for k, v in mapping.items() if k in _KEYWORDS and k not in ("image", "conditions") and v is not None}
