"""A request against a recipe, resolved with the recipe's defaults and checked before any work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from .base import SpecModel
from .errors import Problem, SpecError, from_validation_error
from .pipeline import PipelineSpec


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


def resolve_request(
    spec: PipelineSpec, prompt: str | list[str], seed: int | list[int] | None = None, **fields: Any
) -> Request:
    """Fill defaults from the recipe and check the request against its constraints.

    One seed per prompt: ``seed`` as a list gives each; an int ``S`` gives prompt ``i`` seed ``S + i``;
    ``None`` uses ``runtime.seed``.
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
    known = set(Request.model_fields) - {"prompts", "seeds"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SpecError.single(f"unknown request field(s) {unknown}; known: {sorted(known)}", "request")
    refused = [name for name, value in fields.items() if value is not None and name in recipe.constraints.refuse]
    if refused:
        raise SpecError.single(f"recipe {spec.name!r} refuses request field(s) {refused}", "request")
    if fields.get("frames") is not None and not recipe.task.endswith("video"):
        raise SpecError.single(f"frames is for video tasks; this recipe's task is {recipe.task!r}", "request.frames")
    if fields.get("guidance_scale") is not None and all(p.guidance.primary is None for p in recipe.phases):
        raise SpecError.single(f"recipe {spec.name!r} has no guidance scale to set (no embedded or CFG-like term)",
                               "request.guidance_scale")

    defaults = recipe.defaults.model_dump()
    values: dict[str, Any] = {k: v for k, v in defaults.items() if k in known}
    values.update({k: v for k, v in fields.items() if v is not None})
    try:
        request = Request(prompts=prompts, seeds=seeds, **values)
    except ValidationError as exc:
        raise from_validation_error(exc, values) from None

    problems = [Problem("request", m) for m in recipe.constraints.size_problems(request.height, request.width)]
    problems += [Problem("request.frames", m) for m in recipe.constraints.frames_problems(request.frames)]
    cap = recipe.constraints.max_sequence_length
    if cap is not None and request.max_sequence_length is not None and request.max_sequence_length > cap:
        problems.append(Problem("request.max_sequence_length", f"{request.max_sequence_length} is above {cap}"))
    if problems:
        raise SpecError(problems)
    return request


def request_fields(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields present (not None) in a mapping such as parsed CLI options."""
    names = set(Request.model_fields) - {"prompts", "seeds"}
    return {k: v for k, v in mapping.items() if k in names and v is not None}
