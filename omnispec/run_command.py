"""``omnispec run``: validate spec, request and output path, then load, generate and write."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .quiet import quiet_libraries
from .spec import SpecError, load_spec
from .spec.request import request_fields, resolve_request


def run_command(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides, trust_code=args.trust_code)
    if not args.prompt:
        raise SpecError.single("give at least one --prompt", "--prompt")
    fields = request_fields(vars(args))
    fields.update(image_fields(args.image or []))
    request = resolve_request(spec, args.prompt, args.seed, **fields)  # checked before any weight loads

    quiet_libraries()
    from .runtime import build
    from .runtime.media import check_output_path

    output_path = Path(args.output)
    check_output_path(output_path, spec.recipe.task.endswith("video"))
    pipe = build(spec, source=args.source, device=args.device, trust_code=args.trust_code)
    try:
        output = pipe.generate(request)
    except (RuntimeError, MemoryError) as exc:
        print(f"error: generation failed: {exc}", file=sys.stderr)
        return 1
    if pipe.parallel is None or pipe.parallel.is_main:  # one writer under torchrun
        for path in output.save(output_path):
            print(path)
    return 0


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

