"""What a family is checked against before any weight loads, as data a family declares on its class, and the checks
that read it.

``Inputs``: what a request may hand the family (images, references, a mask, a video). ``CheckpointMatch``: how a
checkpoint is recognised as one this family runs (``omnispec init``, the checkpoint checks at build). The functions
are the checks every family shares; ``Family.check_spec``, ``check_request`` and ``index_problems`` run them, and a
family that checks more overrides those hooks and calls ``super()`` first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...spec import PipelineSpec, SpecError
from ...spec.guidance import term_of
from ...spec.recipe import VIDEO_TASKS
from ...spec.references import reference_kind
from ...spec.request import Request
from ...targets import Targets


@dataclass(frozen=True)
class Inputs:
    """What a request may hand the family besides its prompts. ``max_images``: request images it conditions on (0:
    text only); ``max_references``, ``reference_kinds``: reference inputs and their kinds (``spec.references``: image,
    video, audio); ``inpaints``: it reads the request's mask and runs the task ``inpainting``, and only that one;
    ``takes_video``: it follows a request's video (and its mask), the task ``video-to-video``; ``masks_references``: it
    reads a mask given with its references (on a video task other than video-to-video) as the weight of the attention
    between the video and the references' pixels (LTX-2.5's IC-LoRA)."""

    max_images: int = 0
    max_references: int = 0
    reference_kinds: tuple[str, ...] = ("image",)
    inpaints: bool = False
    takes_video: bool = False
    masks_references: bool = False


@dataclass(frozen=True)
class CheckpointMatch:
    """How a checkpoint is recognised as one this family runs. ``pipelines``: the pipeline classes its
    ``model_index.json`` names (empty: the family's helper pipeline's, ``checkpoint_pipelines``).
    ``model_index_values``: settings of ``model_index.json`` the family runs as diffusers runs them, with the values it
    accepts (Wan2.2 TI2V's ``expand_timesteps``: a timestep per token); another value is refused before loading.
    ``foreign_components``: components of the checkpoint that another family runs (one checkpoint, one partition per
    workflow), each with what it is: ``omnispec init`` leaves them out of its draft, and a phase may not denoise with
    one. ``flow_match_schedulers``: scheduler classes besides FlowMatchEulerDiscreteScheduler whose schedule a
    ``flow_match`` schedule with the config's ``shift`` reproduces, so ``omnispec init`` drafts one (``shift:
    from_checkpoint``) for them."""

    pipelines: tuple[str, ...] = ()
    model_index_values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    foreign_components: Mapping[str, str] = field(default_factory=dict)
    flow_match_schedulers: tuple[str, ...] = ()


class Declared(Protocol):
    """What the checks read of a family class (``Family`` declares it all): identity, streams, inputs, checkpoints
    and targets."""

    name: str
    pipeline_class: type | None
    required: Mapping[str, str]
    options: Mapping[str, Any]
    streams: tuple[str, ...]
    inputs: Inputs
    checkpoints: CheckpointMatch
    targets: Targets


def checkpoint_pipelines(family: Declared) -> tuple[str, ...]:
    """The pipeline classes a checkpoint's ``model_index.json`` names for the models ``family`` runs (what ``omnispec
    init`` matches): its declared ones, else its helper pipeline's."""
    if family.checkpoints.pipelines:
        return family.checkpoints.pipelines
    return (family.pipeline_class.__name__,) if family.pipeline_class is not None else ()


def spec_problems(family: Declared, spec: PipelineSpec) -> list[str]:
    """What ``family`` cannot run of ``spec``: missing or mis-roled components, guidance terms its targets refuse,
    streams it lacks, a task its inputs do not fit, options it does not read."""
    comps = spec.model.components
    problems = []
    for name, role in family.required.items():
        if name not in comps:
            problems.append(f"family {family.name!r} needs a component named {name!r} (role {role})")
        elif comps[name].role != role:
            problems.append(f"family {family.name!r} needs {name!r} to have role {role!r}")
    for phase in spec.recipe.phases:
        for term in phase.guidance.terms:
            refusal = term_of(term).refusal(term, family.targets)
            if refusal:
                problems.append(f"{refusal} (phase {phase.name!r})")
        unknown = sorted(phase.guidance.streams - set(family.streams))
        if unknown:
            problems.append(f"phase {phase.name!r} scales streams {unknown}; family {family.name!r} has "
                            f"{', '.join(family.streams)}")
    inputs = family.inputs
    if inputs.inpaints != (spec.recipe.task == "inpainting"):
        problems.append(f"family {family.name!r} runs the task inpainting only (it needs the request's mask)"
                        if inputs.inpaints else f"family {family.name!r} does not inpaint: it would ignore the mask of "
                        "an inpainting task (an inpainting family does: omnispec list)")
    if spec.recipe.task == "video-to-video" and not inputs.takes_video:
        problems.append(f"family {family.name!r} takes no video: it would ignore the video of a video-to-video task "
                        "(omnispec list shows the families that take one)")
    unknown_options = sorted(set(spec.model.options) - set(family.options))
    if unknown_options:
        have = ", ".join(family.options) or "none"
        problems.append(f"family {family.name!r} has no option(s) {unknown_options} (options: {have})")
    return problems


def check_inputs(family: Declared, request: Request, spec: PipelineSpec) -> None:
    """Refuse a request whose images, references or mask ``family``'s inputs do not take, naming the field."""
    inputs, name = family.inputs, family.name
    if len(request.images) > inputs.max_images:
        raise SpecError.single(f"family {name!r} conditions on at most {inputs.max_images} image(s), got "
                               f"{len(request.images)}", "request.image")
    if len(request.references) > inputs.max_references:
        takes = f"at most {inputs.max_references}" if inputs.max_references else "no"
        noun = "reference image(s)" if inputs.reference_kinds == ("image",) else "reference(s)"
        raise SpecError.single(f"family {name!r} takes {takes} {noun}, got {len(request.references)}",
                               "request.references")
    for k, reference in enumerate(request.references):
        if (kind := reference_kind(reference)) not in inputs.reference_kinds:
            raise SpecError.single(f"family {name!r} takes {' and '.join(inputs.reference_kinds)} references, "
                                   f"not a {kind}", f"request.references.{k}")
    if (request.mask is not None and request.references and not inputs.masks_references
            and spec.recipe.task not in ("inpainting", *VIDEO_TASKS)):
        raise SpecError.single(f"family {name!r} reads no mask with its references (a mask over references "
                               "weighs an IC-LoRA's attention to them: ltx2.5-ic-lora)", "request.mask")


def model_index_problems(family: Declared, index: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(where, why) for each setting of the checkpoint's ``model_index.json`` that ``family`` would run otherwise
    than diffusers runs it (its ``checkpoints.model_index_values``)."""
    problems = []
    for key, accepted in family.checkpoints.model_index_values.items():
        if index.get(key) not in accepted:
            problems.append(("model.family", (
                f"the checkpoint's model_index.json has {key}: {json.dumps(index.get(key))}, which family "
                f"{family.name!r} does not run (it runs {key} {' or '.join(json.dumps(a) for a in accepted)}): "
                "another variant of the model, which another family runs (omnispec list)")))
    return problems
