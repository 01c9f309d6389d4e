"""Per-step denoise time of every family with a diffusers pipeline, at real sizes (random bf16 weights), and MFU.
Peer: the family's diffusers pipeline, eager, on the same in-memory modules in the same call (``--also``: a third
side, omnispec with one more override).

``python -m benchmarks.gpu_interpreter [--workloads flux,wan] [--repeats 3] [--json FILE]``  (needs CUDA)

Both run the same in-memory modules (omnispec gets them through ``build(..., components=...)``), the
same prompt, size and seed, with latents returned undecoded. Per-step time is the difference between
a long and a short run divided by the step difference, so prompt encoding and set-up cancel out. MFU
is FLOPs per step (counted by torch's FlopCounterMode on one denoiser forward) over the measured
bf16 matmul ceiling of this GPU. Rounds alternate between the two sides (``per_step_sides``); ``--also OVERRIDE``
adds a third, omnispec with that override too over its own copy of the denoisers (an in-process A/B of a policy),
whose latents after the short run are compared with omnispec's (``latent_cosine (omnispec + ...)``), as is its
first step's prediction (``step_cosine (omnispec + ...)``: the denoiser's first output, row 0, in a one-step run;
the latents after a short run start from the same noise, which hides most of a step's error).
``--then OVERRIDE`` (repeatable) adds sides timed after the interleaved rounds, one at a time, each omnispec with
its override over the same modules (no copy: what a side does to them in place, fp8 quantization or model offload's
move to host memory, stays for the sides after it, so give them in that order): for models whose denoiser fits the
card once but not twice (FLUX.2 [dev]'s 32B on an 80 GB card). Each reports its step, its ``lo``-step request, its
peak device memory, its ratio against the interleaved diffusers median (``ratio (then ...)``, not interleaved) and
its latents' and first step's prediction's cosines against omnispec's.

The workloads (``benchmarks/workloads.py``) cover every family with a diffusers pipeline (all but the embedded
digits model, which has none); ``ltx2`` and ``ltx2_condition`` are timed by LTX-2's step comparison there, which
``benchmarks/gpu_ltx2.py``'s step and keyframes parts run too.
"""

from __future__ import annotations

import copy
import functools

import torch

from . import harness
from .workloads import WORKLOADS, conditioning_inputs, ltx2_row, vace_keyframes


def measure(name: str, repeats: int, ceiling: float, overrides: list[str] = (), also: list[str] = (),
            then: list[str] = ()) -> dict:
    """One workload's per-step time, omnispec (``overrides``) against diffusers on the same modules, interleaved;
    with ``also``, a third side: omnispec with those overrides too, over its own copy of the denoisers (a policy may
    change the modules it is given, which the first side shares with diffusers)."""
    import diffusers

    import omnispec
    from omnispec.spec.request import resolve_request

    w = WORKLOADS[name]
    if "ltx2_part" in w:
        row = ltx2_row(name, w["ltx2_part"], repeats, ceiling, list(overrides), list(also))
        return {**row, **({"then": "not measured: LTX-2's comparison has no --then sides"} if then else {})}
    mods = w["components"]()
    pipe = omnispec.build(harness.ROOT / "specs" / w["spec"], components=mods, device=harness.DEVICE,
                          overrides=["runtime.progress=false", *w.get("overrides", ()), *overrides])
    if "reference" in w:  # a modular pipeline (no DiffusionPipeline): the workload's own runner, latents out
        ref = w["reference"](mods)
    else:
        ref = getattr(diffusers, w["pipeline"])(**mods, **w.get("diffusers_only", dict)())  # e.g. HunyuanVideo's guider
        ref.set_progress_bar_config(disable=True)

    def run_ours(n, pipe=pipe):
        pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **w["request"]), decode=False)

    def run_ref(n):
        if "reference" in w:
            return ref(n, **w["diffusers_kwargs"])
        return ref(prompt="a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="latent", **w["diffusers_kwargs"])

    sides = {"diffusers": run_ref, "omnispec": run_ours}
    others = {}  # the third side's pipeline by its label
    if also:
        denoisers = {k: copy.deepcopy(v) for k, v in mods.items() if k.startswith("transformer")}
        other = omnispec.build(harness.ROOT / "specs" / w["spec"], components={**mods, **denoisers},
                               device=harness.DEVICE,
                               overrides=["runtime.progress=false", *w.get("overrides", ()), *overrides, *also])
        others[f"omnispec + {' + '.join(also)}"] = other
        sides[f"omnispec + {' + '.join(also)}"] = functools.partial(run_ours, pipe=other)

    if w.get("inputs") == ("keyframes",):  # VACE: omnispec's conditions, diffusers' video and mask of them
        conditions, theirs = vace_keyframes(w["request"]["height"], w["request"]["width"], w["request"]["frames"])
        w = {**w, "request": {**w["request"], "conditions": conditions},
             "diffusers_kwargs": {**w["diffusers_kwargs"], **theirs}}
    elif w.get("inputs"):  # an image (and a mask of its size), the same for both sides
        size = w.get("image_size") or (w["request"]["height"], w["request"]["width"])
        given = dict(zip(("image", "mask"), conditioning_inputs(*size)))
        given["references"] = [given["image"]]  # the image as the one reference (the runner wraps it for diffusers)
        given["video"] = [given["image"]] * w["request"].get("frames", 1)  # a still video of the picture
        ours = {k: given[k] for k in w["inputs"]}
        theirs = {{"mask": "mask_image"}.get(k, k): v for k, v in ours.items()}
        w = {**w, "request": {**w["request"], **ours}, "diffusers_kwargs": {**w["diffusers_kwargs"], **theirs}}
    lo, hi = w["steps"]
    if not harness.SMOKE:  # --smoke: no timing worth warming up for
        harness.warm_up_sides(sides, lo, hi, overrides, also)
    flops = w["flops"](pipe, w["request"]) if "flops" in w else harness.flops_per_step(run_ours)
    with torch.no_grad():
        timed = harness.per_step_sides(sides, lo, hi, repeats)
    results = {label: {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "mfu": flops / med / ceiling}
               for label, (med, samples) in timed.items()}
    for label, other in others.items():
        results[label] |= preset_outcome(other)
    # Equality of the two runs' latents (same seed), bf16; decoded images where the pipeline's "latent" output is
    # not its loop's latents (FLUX.2 returns them unpacked and denormalised).
    images = w.get("compare") == "images"
    a = pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=lo, **w["request"]), decode=images)
    a = torch.from_numpy(a.array) if images else a.latents[w.get("stream", "latents")]
    if "reference" in w:
        b = run_ref(lo)
    else:
        b = ref(prompt="a photo of a cat", num_inference_steps=lo, generator=torch.Generator("cpu").manual_seed(0),
                output_type="np" if images else "latent", **w["diffusers_kwargs"])
        b = (b.images if hasattr(b, "images") else b.frames)
        b = torch.from_numpy(b) if images else b
    cos = harness.cosine(a, b)
    # The other sides' quality against omnispec's (an approximate policy against the same run without): their latents
    # after the short run, and one step's prediction (the denoiser's first output, row 0, in a one-step run), which
    # the latents would hide under the noise they start from. Only between omnispec's sides: they batch guidance
    # passes alike, where diffusers' pipelines differ in which pass comes first.
    quality: dict[str, float] = {}
    if others or then:
        step, _ = harness.first_output(run_ours, *(m for k, m in mods.items() if k.startswith("transformer")))
    for label, other in others.items():
        c = other.generate(resolve_request(other.spec, "a photo of a cat", 0, steps=lo, **w["request"]), decode=images)
        c = torch.from_numpy(c.array) if images else c.latents[w.get("stream", "latents")]
        quality[f"latent_cosine ({label})"] = harness.cosine(c, a)
        copies = [m for k, m in other.components.items() if k.startswith("transformer")]
        quality[f"step_cosine ({label})"] = harness.cosine(
            harness.first_output(functools.partial(run_ours, pipe=other), *copies)[0], step)
    sides = others = None
    for override in then:  # after the rounds, over the same modules; the earlier sides' pipelines stay built
        label = f"then {override}"
        results[label], quality[f"latent_cosine ({label})"], quality[f"step_cosine ({label})"] = then_side(
            w, [*overrides, override], mods, (a, step), flops, ceiling, repeats, images)
    out = {"workload": name, "overrides": list(overrides), "tflop_per_step": flops / 1e12, **results,
           "ratio": results["omnispec"]["ms_per_step"] / results["diffusers"]["ms_per_step"],
           **{f"ratio ({label})": r["ms_per_step"] / results["diffusers"]["ms_per_step"]
              for label, r in results.items() if label not in ("diffusers", "omnispec")},
           "latent_cosine": cos, "latent_max_abs_diff": (a.float() - b.float()).abs().max().item(), **quality}
    pipe = ref = mods = sides = others = None  # free the GPU memory before the next workload
    harness.free_device_memory(compiled=True)
    return out


def then_side(w: dict, overrides: list[str], mods: dict, exact: tuple[torch.Tensor, torch.Tensor], flops: float,
              ceiling: float, repeats: int, images: bool) -> tuple[dict, float, float]:
    """One ``--then`` side: omnispec built over ``mods`` themselves with ``overrides``, timed alone; its row, and its
    short run's output's and first step's prediction's cosines against ``exact`` (omnispec's without the override)."""
    import omnispec
    from omnispec.spec.request import resolve_request

    harness.free_device_memory()
    if harness.DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pipe = omnispec.build(harness.ROOT / "specs" / w["spec"], components=mods, device=harness.DEVICE,
                          overrides=["runtime.progress=false", *w.get("overrides", ()), *overrides])

    def run(n: int, decode: bool = False):
        return pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **w["request"]), decode=decode)

    lo, hi = w["steps"]
    if not harness.SMOKE:
        harness.warm_up(run, lo, hi, harness.warm_up_rounds(overrides))
    with torch.no_grad():
        med, samples = harness.per_step(run, lo, hi, repeats)
        request, _ = harness.per_request(run, lo, max(1, repeats // 2))
    c = run(lo, decode=images)
    c = torch.from_numpy(c.array) if images else c.latents[w.get("stream", "latents")]
    step, _ = harness.first_output(run, *(m for k, m in pipe.components.items() if k.startswith("transformer")))
    peak = torch.cuda.max_memory_allocated() / 2**30 if harness.DEVICE == "cuda" else 0.0
    row = {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "mfu": flops / med / ceiling,
           "request_s": request, "request_steps": lo, "peak_gib": peak, "timed": "alone, after the rounds",
           **preset_outcome(pipe)}
    return row, harness.cosine(c, exact[0]), harness.cosine(step, exact[1])


def preset_outcome(pipe) -> dict:
    """What a side's ``policies.preset`` turned on and left out on this machine (FlashAttention-4 only where the
    package is installed, fp8 only where the card has fp8 matmuls): a row names what it timed."""
    record = pipe.preset_record()
    return {"preset": record} if record is not None else {}


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="flux,wan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="omnispec spec override")
    parser.add_argument("--also", action="append", default=[], metavar="OVERRIDE",
                        help="a third side timed in the same rounds: omnispec with this override too (repeatable), "
                             "over its own copy of the denoisers; e.g. --also policies.mlp.fused_gelu=true")
    parser.add_argument("--then", action="append", default=[], metavar="OVERRIDE",
                        help="a side timed alone after the rounds: omnispec with this override too, over the same "
                             "modules (repeatable, in order; for denoisers that fit the card only once), e.g. "
                             "--then 'policies.offload={strategy: model}'")


def benchmark(args, results: harness.Results) -> None:
    ceiling = harness.matmul_ceiling()
    results.header["ceiling_tflops"] = ceiling / 1e12
    print(f"{harness.device_name()}  torch {torch.__version__}  bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    for name in args.workloads.split(","):
        results.save(measure(name, args.repeats, ceiling, args.overrides, args.also, args.then))
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| workload | TFLOP/step | diffusers ms/step (MFU) | omnispec ms/step (MFU) | ratio | latent cosine |")
    for r in rows:
        print(f"| {r['workload']} | {r['tflop_per_step']:.1f} | {r['diffusers']['ms_per_step']:.1f} "
              f"({r['diffusers']['mfu']:.0%}) | {r['omnispec']['ms_per_step']:.1f} ({r['omnispec']['mfu']:.0%}) | "
              f"{r['ratio']:.3f} | {r['latent_cosine']:.5f} |")
        for label in (k for k in r if k.startswith(("omnispec + ", "then "))):
            print(f"| {r['workload']}, {label.removeprefix('omnispec + ')} | | | {r[label]['ms_per_step']:.1f} "
                  f"({r[label]['mfu']:.0%}) | {r[f'ratio ({label})']:.3f} | "
                  f"{r[f'latent_cosine ({label})']:.5f}, step {r[f'step_cosine ({label})']:.5f} against omnispec |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark)


if __name__ == "__main__":
    main()
