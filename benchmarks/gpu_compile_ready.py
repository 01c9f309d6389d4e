"""Seconds until a video model's blocks are ready under compile: regional, with a cold and with a warm inductor cache.
No peer: the figure is held against the target itself (a video model's compiled blocks ready in 60 s or less on a
warm cache). The first call is timed against a steady call, in a process with a cold inductor cache, then in a
second process that finds the first one's cache warm.

``python -m benchmarks.gpu_compile_ready [--workloads wan_ti2v,ltx2] [--steps 2] [--set OVERRIDE ...]
[--cache-dir DIR] [--json FILE]``  (needs CUDA; ``--smoke``: tiny models on the CPU with the aot_eager backend,
which caches nothing, to check the script only.)

A workload is one of ``gpu_interpreter``'s text-to-video ones (its modules at real sizes with random bf16 weights, its
request: ``wan`` is Wan2.1 14B at 480x832x81, ``wan_ti2v`` Wan2.2 TI2V-5B at 704x1280x121, ``hunyuan_video15``
HunyuanVideo-1.5 at 480x848x121) or ``ltx2`` (LTX-2 19B's modules at 512x768x121, video and audio; ``ltx23`` LTX-2.3's,
``workloads.ltx23_components``). Per workload, two child processes of this script run one after the other with one
inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``: a fresh one, or ``--cache-dir``). Each builds the pipeline with
``policies.compile.mode=regional`` (and each ``--set``), then runs the request of ``--steps`` steps three times:
``ready_s`` is the first call less the median of the other two, so compiling and first-use work (autotuning at first
launch, the allocator's growth) and nothing of the steps themselves. Each row: the process's cache (cold or warm), its
first and steady calls, ready_s, dynamo's graphs, breaks and recompiles, the seconds of each compile phase (dynamo
tracing, AOTAutograd, inductor), and the cache folder's size after it. A warm cache shortens inductor's code generation
and AOTAutograd's, never dynamo's tracing (``harness.CompileWatch``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import harness
from .flow_grpo import timed
from .workloads import LTX2_SIZE, WORKLOADS, ltx2_components, ltx2_spec_overrides, ltx23_components

# LTX-2 and LTX-2.3 (video and audio) at LTX2_SIZE: their specs and modules (the one-stage specs take no upsampler)
LTX = {"ltx2": ("ltx2-t2v.yaml", ltx2_components), "ltx23": ("ltx2.3-t2v.yaml", ltx23_components)}

PROMPT = "a lighthouse on a cliff at dusk, waves below, slow camera pan"


def workload(name: str) -> tuple[str, object, list[str], dict]:
    """``name``'s spec, modules builder, spec overrides and request: a text-to-video workload of ``WORKLOADS``, or
    LTX-2's or LTX-2.3's (``LTX``)."""
    if name in LTX:
        spec, components = LTX[name]

        def modules() -> dict:
            return {k: v for k, v in components().items() if k != "latent_upsampler"}

        return spec, modules, ltx2_spec_overrides(), dict(LTX2_SIZE)
    w = WORKLOADS.get(name)
    if w is None or "spec" not in w or w.get("inputs") or "frames" not in w["request"]:
        video = sorted(k for k, v in WORKLOADS.items() if "spec" in v and not v.get("inputs")
                       and "frames" in v["request"])
        raise harness.UsageError(f"--workloads: {name!r} is not a text-to-video workload; choose from "
                                 f"{', '.join([*LTX, *video])}")
    return w["spec"], w["components"], ["runtime.progress=false", *w.get("overrides", ())], w["request"]


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="wan_ti2v,ltx2")
    parser.add_argument("--steps", type=int, default=2, help="steps of each call")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="omnispec spec override")
    parser.add_argument("--cache-dir", type=Path, help="the inductor cache folder both processes share (default: a "
                                                       "fresh one per workload, so the first process finds it cold)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the workload a child process measures
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)  # where it writes its row


def child(args) -> dict:
    """One process's row: build with regional compile, three calls."""
    import omnispec

    spec, components, overrides, request = workload(args.child)
    backend = ["policies.compile.backend=aot_eager"] if args.smoke else []  # inductor's CPU codegen: minutes
    with harness.CompileWatch() as watch:
        pipe = omnispec.build(harness.ROOT / "specs" / spec, components=components(), device=harness.DEVICE,
                              overrides=[*overrides, "policies.compile.mode=regional", *backend, *args.overrides])
        req = pipe.request(PROMPT, 0, steps=args.steps, **request)
        with torch.no_grad():
            calls = [timed(lambda: pipe.generate(req, decode=False))[0] for _ in range(3)]
    steady = statistics.median(calls[1:])
    return {"first_call_s": calls[0], "steady_call_s": steady, "ready_s": calls[0] - steady, "calls_s": calls,
            "dynamo": watch.summary()}


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def benchmark(args, results: harness.Results) -> None:
    if args.child:
        row = child(args)
        args.child_out.write_text(json.dumps(row))
        return
    names = [n for n in args.workloads.split(",") if n]
    for name in names:
        workload(name)  # refuse a wrong name before any process starts
    results.header |= {"device": harness.device_name(), "torch": torch.__version__,
                       "setup": {k: str(v) for k, v in vars(args).items() if k not in ("json", "child", "child_out")}}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="compile-ready-") as tmp:
            cache = args.cache_dir or Path(tmp) / "inductor"
            cache.mkdir(parents=True, exist_ok=True)
            for state in ("cold", "warm"):
                out = Path(tmp) / f"{state}.json"
                cmd = [sys.executable, "-m", "benchmarks.gpu_compile_ready", "--child", name, "--child-out", str(out),
                       "--steps", str(args.steps), *[f"--set={o}" for o in args.overrides],
                       *(["--smoke"] if args.smoke else [])]
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH")]))}
                proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True)
                if proc.returncode != 0 or not out.exists():
                    results.save({"workload": name, "cache": state,
                                  "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]})
                    break
                results.save({"workload": name, "cache": state, **json.loads(out.read_text()),
                              "cache_mb_after": round(_folder_mb(cache), 1)})
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| workload | cache | first call s | steady call s | ready s | dynamo / AOTAutograd / inductor s |")
    for r in rows:
        if "ready_s" in r:
            s = r["dynamo"]["compile_seconds"]
            phases = " / ".join(f"{s.get(k, 0.0):.1f}" for k in ("dynamo tracing", "aot autograd", "inductor"))
            print(f"| {r['workload']} | {r['cache']} | {r['first_call_s']:.1f} | {r['steady_call_s']:.1f} | "
                  f"{r['ready_s']:.1f} | {phases} |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, needs_cuda=True,
                          smoke="tiny models on the CPU, aot_eager (checks the script only)")


if __name__ == "__main__":
    main()
