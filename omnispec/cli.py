"""``omnispec run | explain | list | init | validate | schema``.

Exit codes: 0 ok, 2 bad input (spec, override, request, missing file or checkpoint), 1 a failure while
running. A user's mistake prints one line per problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .spec import SpecError, explain_spec, json_schema, load_spec, render_explain
from .spec.base import MAX_LORA_SCALE
from .spec.catalog import LIST_HINT, bundled_path
from .spec.errors import LONGEST_MESSAGE, LaunchError, printable, quoted, quoted_values_shortened, shortened
from .spec.files import path_kind
from .spec.suggest import did_you_mean, nearby_files
from .version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose own errors (a bad option value, a missing argument) are one ``error:`` line and exit 2,
    as every other bad input is; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        from .log import say_once_per_launch

        # under torchrun every rank parses the same arguments: rank 0 says it. argparse quotes the value it refused
        # whole: a long one shortened as every error line shortens it
        say_once_per_launch([f"error: {printable(shortened(quoted_values_shortened(message), LONGEST_MESSAGE))}"])
        raise SystemExit(2)


def say(text: str) -> None:
    """Print lines that may hold strings from files (a record, a spec), each with its control characters escaped
    (no escape sequence of a hostile record reaches the terminal)."""
    print("\n".join(printable(line) for line in text.split("\n")))


def _add_spec_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field by dotted path, e.g. recipe.phases.0.schedule.steps=8 (repeatable)")
    p.add_argument("--trust-code", action="store_true",
                   help="trust the spec's and the checkpoint's code: allow 'package.module:Class' references outside "
                        "diffusers/transformers/omnispec, a checkpoint's own Python files (trust_remote_code), the "
                        "attention kernels and quantizers its configs name that load code from the Hub, and pickled "
                        "weights (.bin/.pt/.ckpt); never implied by a spec or an output's record")


def _add_verbosity(p: argparse.ArgumentParser, default: object) -> None:
    """``-v``/``-q`` on the main parser and on every command (so they may come after the command too)."""
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="more detail: -v the libraries' info messages, -vv debug")
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="errors only: no progress bars or progress lines")


def sigma_list(value: str) -> list[float]:
    """``1.0,0.9,0.7``: the numbers of a request's ``sigmas`` (their range and order are the request's checks)."""
    try:
        return [float(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected numbers separated by commas, e.g. 1.0,0.75,0.5") from None


def lora_argument(value: str) -> dict[str, object]:
    """``PATH_OR_ID[:WEIGHT_NAME][@SCALE]`` as an adapter slot (an existing path wins over splitting it)."""
    path, scale = value, 1.0
    if "@" in value and path_kind(value) is None:
        head, _, tail = value.rpartition("@")
        try:
            path, scale = head, float(tail)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: the part after '@' is the scale, a number (got "
                                             f"{tail!r})") from None
        if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            raise argparse.ArgumentTypeError(f"{value!r}: the scale after '@' lies within +-{MAX_LORA_SCALE:g} (got "
                                             f"{tail!r})")
    weight_name = None
    if ":" in path and path_kind(path) is None:
        path, _, weight_name = path.rpartition(":")
    if not path or weight_name == "":
        raise argparse.ArgumentTypeError(f"{value!r}: expected PATH_OR_ID[:WEIGHT_NAME][@SCALE]")
    return {"path": path, **({"weight_name": weight_name} if weight_name else {}), "scale": scale, "always": True}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="omnispec", description="Run diffusion models described by one typed spec.")
    parser.add_argument("--version", action="version", version=f"omnispec {__version__}")
    _add_verbosity(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}

    def command(name: str, help: str) -> argparse.ArgumentParser:
        commands[name] = p = sub.add_parser(name, help=help)
        _add_verbosity(p, argparse.SUPPRESS)
        return p

    p = command("run", "run a spec and write its outputs")
    p.add_argument("spec", metavar="SPEC", nargs="?", help="a spec file or a bundled spec's name (omnispec list)")
    p.add_argument("--from", dest="from_output", metavar="OUTPUT",
                   help="make OUTPUT again from what it records (spec, request, checkpoint); request options and "
                        "--set given here change it")
    p.add_argument("--source", help="checkpoint root (local directory or Hub id) replacing model.source")
    p.add_argument("--prompt", action="append", help="prompt (repeat for a batch)")
    p.add_argument("--negative-prompt")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--sigmas", type=sigma_list, metavar="S1,S2,...",
                   help="custom sigmas, one step each (diffusers' sigmas=): comma-separated, decreasing, in (0, 1]")
    p.add_argument("--guidance-scale", type=float, help="primary guidance scale of every phase")
    p.add_argument("--max-sequence-length", type=int)
    p.add_argument("--image", action="append", metavar="PATH[@FRAME]",
                   help="conditioning image (image-to-image, image-to-video, editing); repeat with @FRAME to place "
                        "images at frames of a video (e.g. --image first.png --image last.png@-1)")
    p.add_argument("--reference", action="append", metavar="PATH",
                   help="a reference image the output should show (a subject, a style; Wan VACE, MiniMax-H3 ref2va), "
                        "repeatable; references are read in the order given, with --reference-video/-audio")
    p.add_argument("--reference-video", action="append", dest="reference", type=lambda path: {"video": path},
                   metavar="PATH", help="a reference video (a motion; MiniMax-H3 ref2va) with its frame rate and its "
                                        "sound: MP4/MOV/WebM with the video extra, or an animated GIF/WebP/PNG "
                                        "(no sound; its rate is the model's own), repeatable")
    p.add_argument("--reference-audio", action="append", dest="reference", type=lambda path: {"audio": path},
                   metavar="PATH", help="a reference sound (a voice, music; MiniMax-H3 ref2va): a PCM WAV file, or "
                                        "the sound of an MP4/MOV/WebM file with the video extra, repeatable")
    p.add_argument("--video", metavar="PATH",
                   help="video-to-video: the video the output follows frame by frame (a control video such as poses "
                        "or depth, or one to repaint): an animated GIF/WebP/PNG, or MP4/MOV/WebM with the video extra; "
                        "its frame count and size are the output's unless --frames/--height/--width say otherwise")
    p.add_argument("--mask", metavar="PATH", help="inpainting mask of the image's size: white is repainted, black "
                                                   "kept (grey rounds at 0.5); with --video one image for every frame "
                                                   "or an animated file with a mask per frame")
    p.add_argument("--mask-blur", type=int, metavar="RADIUS",
                   help="blur the mask first (diffusers' Gaussian blur, radius in pixels)")
    p.add_argument("--strength", type=float, help="image-to-image: how far the image is re-noised (0..1)")
    p.add_argument("--fps", type=int, help="frame rate of a video request")
    p.add_argument("--seed", type=int, help="seed of the first prompt; prompt i gets seed + i (default: runtime.seed)")
    p.add_argument("--lora", action="append", type=lora_argument, metavar="PATH_OR_ID[:WEIGHT_NAME][@SCALE]",
                   help="add a LoRA (a file, a folder or a Hub id; diffusers, kohya/ComfyUI or XLabs layout) to the "
                        "first phase's denoiser, on in every phase (repeatable); e.g. style.safetensors@0.8, "
                        "owner/repo:lora.safetensors")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: the spec's runtime.device)")
    p.add_argument("--output", required=True, help="output file: .png (.jpg, .webp) for images, .gif, .mp4 or .png "
                   "for videos, .npy for the decoded array")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file (refused otherwise)")
    p.add_argument("--allow-version-drift", action="store_true",
                   help="with --from: replay a record made by another omnispec major.minor or diffusers minor (the "
                        "new output's record says it drifted)")
    _add_spec_options(p)

    p = command("explain", "show the resolved run without loading weights, or what made an output")
    p.add_argument("spec", metavar="SPEC_OR_OUTPUT",
                   help="a spec file, a bundled spec's name, or an output omnispec wrote (.png, .mp4, .npy ...)")
    p.add_argument("--source", help="checkpoint root whose config files (no weights) resolve the plan")
    p.add_argument("--estimate", action="store_true",
                   help="estimate parameter bytes (safetensors headers), FLOPs per denoiser forward, peak device memory "
                        "and time per step, loading no weights and timing nothing")
    p.add_argument("--device-kind", metavar="KIND",
                   help="the device the estimate's times are for, by its published peaks: h200, h100, a100, l40s, "
                        "4090 or cpu (default: this machine's)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    _add_spec_options(p)

    command("list", "list the bundled specs (name, family, task, source)")

    p = command("init", "draft a spec from a checkpoint's model_index.json, or from one weights file")
    p.add_argument("source", metavar="SOURCE", help="a local checkpoint directory, a Hub id, or one .safetensors / "
                                                    ".gguf file (its model is recognised from its keys)")
    p.add_argument("--source", dest="file_source", metavar="CHECKPOINT",
                   help="with a weights file: the diffusers checkpoint (folder or Hub id) that gives its config and "
                        "the other components (default: the model's diffusers checkpoint on the Hub)")
    p.add_argument("-o", "--output", help="write the spec here (default: print it)")
    p.add_argument("--family", help="the family adapter to use when the checkpoint's pipeline class names another "
                                    "(e.g. flux_kontext, ltx2_condition)")
    p.add_argument("--name", help="the spec's name (default: the checkpoint's folder or repository name)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")

    p = command("validate", "check specs; exit 0 when all are valid")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    _add_spec_options(p)

    command("schema", "print the JSON Schema of a spec")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .log import configure, harmless_messages_demoted, say_once_per_launch

    configure(-1 if args.quiet else (args.verbose or 0))
    try:
        with harmless_messages_demoted():  # what dependencies say on import about parts they lack
            return _dispatch(args)
    except SpecError as exc:
        # under torchrun every rank finds the same mistake in the input: rank 0 says it; a launch that is wrong
        # itself, every rank
        lines = [printable(f"error: {problem}") for problem in exc.problems]
        if isinstance(exc, LaunchError):
            print("\n".join(lines), file=sys.stderr)
        else:
            say_once_per_launch(lines)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped early (omnispec list | head): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    handlers = {"validate": _validate, "schema": _schema, "explain": _explain, "list": _list, "init": _init,
                "run": _run}
    return handlers[args.command](args)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from .run_command import run_command

    return run_command(args)


def _explain(args: argparse.Namespace) -> int:
    from . import records

    if records.is_output(args.spec) and not os.path.lexists(args.spec) and bundled_path(args.spec) is None:
        raise SpecError.single(_no_such_output(args.spec), "SPEC_OR_OUTPUT")
    if records.is_output(args.spec) and os.path.lexists(args.spec):  # a broken link too: read() says why
        record = records.read(args.spec)
        say(json.dumps(record.data(), indent=2) if args.json else records.render(record, args.spec))
        return 0
    spec = load_spec(args.spec, args.overrides, trust_code=args.trust_code, overrides_from="--set")
    sigmas = None
    configs = None
    if args.source:
        from .spec.checkpoint import checkpoint_problems, follow_checkpoint, read_configs
        from .spec.hub import check_reachable

        check_reachable(args.source, "--source")
        configs = read_configs(spec, args.source, trusted=args.trust_code)
        from .runtime.families import family_class

        problems = checkpoint_problems(spec, configs, family_class(spec.model.family).checkpoints.foreign_components)
        if problems:
            raise SpecError(problems)
        spec = follow_checkpoint(spec, configs)
        from .runtime.phases import checkpoint_sigmas

        sigmas = checkpoint_sigmas(spec, configs.schedulers, spec.recipe.defaults.steps)
    from .spec.explain import describe_weights

    weights = describe_weights(spec, configs, args.source or spec.model.source)
    plain, with_gradients = _planned_attention(spec)
    info = explain_spec(spec, phase_sigmas=sigmas, attention=plain, attention_with_gradients=with_gradients,
                        weights=weights)
    text = None if args.json else render_explain(info)
    if args.estimate:
        from .estimate import estimate, render_estimate
        from .spec.hub import offline_unless_needed

        offline_unless_needed(spec, args.source, downloads=False)  # the estimate reads files on disk only

        found = estimate(spec, source=args.source, kind=args.device_kind, trust_code=args.trust_code)
        info["estimate"] = found.as_dict()
        text = None if args.json else f"{text}\n{render_estimate(found)}"
    say(json.dumps(info, indent=2) if args.json else text)
    return 0


def _no_such_output(name: str) -> str:
    """An output to explain (by its suffix) that is not there: the nearest outputs beside it, and the specs."""
    from .records import OUTPUT_SUFFIXES

    near = did_you_mean(nearby_files(Path(name), OUTPUT_SUFFIXES))
    return f"no such file {quoted(name)} (an output to explain, by its suffix){near} ({LIST_HINT})"


def _planned_attention(spec) -> tuple[dict[str, str], dict[str, str]]:
    """The attention policy's default and per-role entries: the backend each asks for, without and with gradients."""
    from .spec.attention_plan import planned_attention

    return planned_attention(spec)


def _list(args: argparse.Namespace) -> int:
    from .spec.catalog import catalog

    entries = catalog()
    width = max(len(e.name) for e in entries)
    family = max(len(e.family) for e in entries)
    task = max(len(e.task) for e in entries)
    print(f"{'name':<{width}}  {'family':<{family}}  {'task':<{task}}  source")
    for e in entries:
        source = "(bundled weights)" if e.source and Path(e.source).is_dir() else e.source or "-"
        print(f"{e.name:<{width}}  {e.family:<{family}}  {e.task:<{task}}  {source}")
    return 0


def _init(args: argparse.Namespace) -> int:
    from .draft import draft_from_file, draft_spec, is_weights_file

    if is_weights_file(args.source):
        text = draft_from_file(args.source, family=args.family, name=args.name, source=args.file_source)
    elif args.file_source:
        raise SpecError.single("--source is for a weights file; SOURCE is already a checkpoint", "--source")
    else:
        text = draft_spec(args.source, family=args.family, name=args.name)
    if not args.output:
        print(text, end="")
        return 0
    from .runtime.media import write_files

    target = Path(args.output)
    if path_kind(target) == "dir":
        raise SpecError.single(f"{target} is a directory; give a file name such as {target / 'spec.yaml'}", "--output")
    if path_kind(target) is not None and not args.overwrite:
        raise SpecError.single(f"{target} exists; pass --overwrite to replace it", "--output")
    write_files([(target, lambda t: t.write_text(text, encoding="utf-8"))], overwrite=args.overwrite)
    print(target)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .log import main_process, say_once_per_launch

    speaks = main_process()  # under torchrun every rank reads the same specs: rank 0 says what it found
    unsaid: list[str] = []  # another rank's error lines, said only where rank 0 never says its own
    failed = False
    for path in args.specs:
        try:
            spec = load_spec(path, args.overrides, trust_code=args.trust_code, overrides_from="--set")
        except SpecError as exc:
            failed = True
            lines = [printable(f"error: {problem}") for problem in exc.problems]
            if speaks:
                print("\n".join(lines), file=sys.stderr)
            else:
                unsaid += lines
            continue
        if speaks:
            print(f"{Path(path)}: ok ({spec.name}, {len(spec.recipe.phases)} phase(s))")
    if failed:
        say_once_per_launch(unsaid)  # rank 0: that it spoke; another rank: wait for that
    return 2 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
