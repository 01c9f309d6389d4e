"""``omnispec validate | schema | explain | run``.

Exit codes: 0 ok, 2 bad input (spec, override, request, missing file or checkpoint), 1 a failure while
running. A user's mistake prints one line per problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .spec import SpecError, explain_spec, json_schema, load_spec, render_explain


def _add_spec_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field by dotted path, e.g. recipe.phases.0.schedule.steps=8 (repeatable)")
    p.add_argument("--trust-code", action="store_true",
                   help="allow 'package.module:Class' references outside diffusers/transformers/omnispec")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnispec", description="Run diffusion models described by one typed spec.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check specs; exit 0 when all are valid")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    _add_spec_options(p)

    sub.add_parser("schema", help="print the JSON Schema of a spec")

    p = sub.add_parser("explain", help="show the resolved run without loading weights")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--source", help="checkpoint root whose config files (no weights) resolve the plan")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    _add_spec_options(p)

    p = sub.add_parser("run", help="run a spec and write its outputs")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--source", help="checkpoint root (local directory or Hub id) replacing model.source")
    p.add_argument("--prompt", action="append", help="prompt (repeat for a batch)")
    p.add_argument("--negative-prompt")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance-scale", type=float, help="primary guidance scale of every phase")
    p.add_argument("--max-sequence-length", type=int)
    p.add_argument("--image", action="append", metavar="PATH[@FRAME]",
                   help="conditioning image (image-to-image, image-to-video, editing); repeat with @FRAME to place "
                        "images at frames of a video (e.g. --image first.png --image last.png@-1)")
    p.add_argument("--strength", type=float, help="image-to-image: how far the image is re-noised (0..1)")
    p.add_argument("--fps", type=int, help="frame rate of a video request")
    p.add_argument("--seed", type=int, help="seed of the first prompt; prompt i gets seed + i (default: runtime.seed)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: the spec's runtime.device)")
    p.add_argument("--output", required=True, help="output file: .png, .gif, .mp4 or .npy")
    _add_spec_options(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "schema":
            print(json.dumps(json_schema(), indent=2))
            return 0
        if args.command == "explain":
            return _explain(args)
        if args.command == "run":
            from .run_command import run_command

            return run_command(args)
    except SpecError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _explain(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides, trust_code=args.trust_code)
    sigmas = None
    if args.source:
        from .spec.checkpoint import checkpoint_problems, follow_checkpoint, read_configs

        configs = read_configs(spec, args.source)
        problems = checkpoint_problems(spec, configs)
        if problems:
            raise SpecError(problems)
        spec = follow_checkpoint(spec, configs)
        from .runtime.phases import checkpoint_sigmas

        sigmas = checkpoint_sigmas(spec, configs.schedulers, spec.recipe.defaults.steps)
    info = explain_spec(spec, phase_sigmas=sigmas, attention=_planned_attention(spec))
    print(json.dumps(info, indent=2) if args.json else render_explain(info))
    return 0


def _planned_attention(spec) -> dict[str, str]:
    """Per attention role of the family: the backend the policy asks for and how it will be chosen (the
    checks against this machine happen at build; ``Pipeline.explain()`` shows their outcome)."""
    from .quiet import quiet_libraries

    quiet_libraries()
    from .runtime.families import family_class

    from .policies.attention import auto_as_sdpa

    policy = spec.policies.attention
    forced = auto_as_sdpa(spec)
    out = {}
    for role in family_class(spec.model.family).attention_roles:
        backend = policy.per_role.get(role, policy.default)
        source = "per_role" if role in policy.per_role else "default"
        if backend == "auto":
            why = (f"sdpa ({forced})" if forced else
                   "auto: the fastest usable exact backend, timed per shape on first use (never slower than sdpa)")
        else:
            why = f"{backend} ({source}; checked by a test call at build"
            why += ", falls back to sdpa if unusable)" if policy.allow_fallback else ")"
        out[role] = why
    return out


def _validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.specs:
        try:
            spec = load_spec(path, args.overrides, trust_code=args.trust_code)
        except SpecError as exc:
            failed = True
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            continue
        print(f"{Path(path)}: ok ({spec.name}, {len(spec.recipe.phases)} phase(s))")
    return 2 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
