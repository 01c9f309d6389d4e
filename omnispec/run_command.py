"""``omnispec run``: validate spec, request, output path and device, then load, generate and write."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .log import progress_bars_disabled
from .records.outputs import check_output_path
from .spec import Problem, SpecError, load_spec
from .spec.devices import check_device_name
from .spec.errors import printable, shortened
from .spec.files import path_kind, user_path
from .spec.hub import is_hub_id, offline_unless_needed
from .spec.request import request_fields, resolve_request


def run_command(args: argparse.Namespace) -> int:
    """Every argument is checked, and every problem reported, before the first weight loads."""
    overrides = list(args.overrides) + lora_overrides(args.lora or [])
    if progress_bars_disabled():
        overrides.append("runtime.progress=false")
    problems: list[Problem] = []
    select = None  # --from a file holding one sample of a request: the request runs whole, that sample is written
    made_by, drift = None, []
    if args.from_output is not None:
        made_by, drift, spec, prompts, seeds, fields, source, select = _from_output(args, overrides)
    else:
        if args.spec is None:
            raise SpecError.single("give a SPEC (a file or a bundled spec's name; omnispec list) or --from OUTPUT",
                                   "spec")
        spec = load_spec(args.spec, overrides, trust_code=args.trust_code, overrides_from="--set")
        prompts, seeds, fields, source = args.prompt, args.seed, {}, args.source
        if not prompts:
            problems.append(Problem("--prompt", "give at least one --prompt"))
    fields.update(request_fields(vars(args)))
    if args.image:
        fields.pop("image", None)
        fields.pop("conditions", None)
        fields.update(image_fields(args.image))
    if args.reference:
        fields["references"] = list(args.reference)
    request = _collect(problems, lambda: resolve_request(spec, prompts, seeds, **fields)) if prompts else None
    problems += lora_problems(args.lora or [])
    output_path = Path(args.output)
    video = spec.recipe.task.endswith("video")
    samples = 1 if select is not None else len(prompts or ()) or 1
    # What needs no model library is told before diffusers and transformers are imported (seconds): the spec, the
    # request's fields, the LoRA arguments, the output path (a .wav's sound track is the family's to say) and the
    # device (torch alone answers whether a cuda:N or mps is here; auto and cpu need not even torch).
    _collect(problems, lambda: check_output_path(output_path, video, samples, overwrite=args.overwrite,
                                                 audio=output_path.suffix.lower() == ".wav"))
    given = args.device is not None
    _collect(problems, lambda: check_device_name(args.device if given else spec.runtime.device,
                                                 "--device" if given else "runtime.device"))
    if problems:
        raise SpecError(problems)
    offline_unless_needed(spec, source)

    from .runtime import build
    from .runtime.families import family_class

    if request is not None:
        _collect(problems, lambda: family_class(spec.model.family).check_request(request, spec))

    if progress_bars_disabled():
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bars
    audio = "audio" in _family_streams(spec)
    _collect(problems, lambda: check_output_path(output_path, video, samples, overwrite=args.overwrite, audio=audio))
    if problems:
        raise SpecError(problems)
    pipe = build(spec, source=source, device=args.device, trust_code=args.trust_code)
    try:
        output = pipe.generate(request)
    except (RuntimeError, MemoryError) as exc:
        print(printable(f"error: generation failed: {exc}"), file=sys.stderr)
        return 1
    if args.from_output is not None:
        from .replaying import marked_as_replay, select_sample

        output = marked_as_replay(output, made_by, drift)
        if select is not None:
            output = select_sample(output, select)
    if pipe.parallel is None or pipe.parallel.is_main:  # one writer under torchrun
        try:
            written = output.save(output_path, overwrite=args.overwrite)
        except OSError as exc:
            print(printable(f"error: cannot write {output_path}: {exc.strerror or exc}"), file=sys.stderr)
            return 1
        for path in written:
            print(path)
    return 0


def _from_output(args: argparse.Namespace, overrides: list[str]) -> tuple[Any, ...]:
    """``--from OUTPUT``: the record, its version drift, and the spec, request and checkpoint it records (a SPEC may
    not be given too); request options and ``--set`` given on the command line change them. Returns the sample to
    keep when the file holds one sample of a request and the prompts and seeds stay as recorded."""
    from . import records
    from .replaying import replay_spec, request_arguments

    if args.spec is not None:
        raise SpecError.single("give either a SPEC or --from OUTPUT, not both (--set changes the recorded spec)",
                               "spec")
    made_by = records.read(args.from_output)
    drift = records.check_versions(made_by, args.allow_version_drift, args.from_output)
    source = args.source if args.source is not None else records.recorded_source(made_by)
    problems = records.replay_problems(made_by, args.source)
    if problems:
        raise SpecError(problems)
    spec = replay_spec(made_by, overrides, trust_code=args.trust_code, overrides_from="--set")
    prompts, seeds, fields = request_arguments(made_by, spec, images=not args.image, mask=not args.mask,
                                               references=not args.reference, video=not args.video)
    select = made_by.sample
    if args.prompt is not None or args.seed is not None:  # a new request: from the file's own sample, if it has one
        if select is not None:
            prompts, seeds = [prompts[select]], [seeds[select]]
        select = None
        prompts = args.prompt if args.prompt is not None else prompts
        seeds = args.seed if args.seed is not None else seeds[0]
    return made_by, drift, spec, prompts, seeds, fields, source, select


def lora_overrides(loras: list[dict[str, Any]]) -> list[str]:
    """``--lora`` values as adapter slots ``lora_0``, ``lora_1`` ..., on in every phase (recorded in the spec, a
    local path resolved so that the record replays from any working directory)."""
    local = [user_path(str(slot["path"])) for slot in loras]
    slots = [{**slot, "path": str(path.resolve())} if path_kind(path) is not None else slot
             for slot, path in zip(loras, local)]
    return [f"model.adapters.lora_{i}={json.dumps(slot)}" for i, slot in enumerate(slots)]


def lora_problems(loras: list[dict[str, Any]]) -> list[Problem]:
    """A ``--lora`` that is neither an existing file or folder nor a Hub id (owner/name)."""
    problems = []
    for slot in loras:
        path = str(slot["path"])
        if path_kind(user_path(path)) is None and not is_hub_id(path):
            problems.append(Problem("--lora", f"{shortened(path)}: no such file or folder, and not a Hub id "
                                              "(owner/name)"))
    return problems


def _family_streams(spec: Any) -> tuple[str, ...]:
    from .runtime.families import family_class

    try:
        return family_class(spec.model.family).streams
    except SpecError:
        return ()


def _collect(problems: list[Problem], check: Any) -> Any:
    """Run one check, adding its problems to ``problems`` instead of stopping at the first."""
    try:
        return check()
    except SpecError as exc:
        problems.extend(exc.problems)
        return None


def image_fields(values: list[str]) -> dict[str, Any]:
    """``--image PATH`` once is the request's image; several, or any with ``@FRAME``, are conditions at frames."""
    placed = []
    for value in values:
        path, at, frame = value.rpartition("@") if "@" in value else (value, "", "0")
        if at and not frame.lstrip("-").isdigit():
            path, frame = value, "0"  # an '@' inside the file name
        placed.append({"image": path, "frame": int(frame)})
    if not placed:
        return {}
    if len(placed) == 1 and "@" not in values[0]:
        return {"image": placed[0]["image"]}
    return {"conditions": placed}
