"""What bounds a compiled fp8 activation quantization? One FLUX single block's output projection, alone.
Peer: variants of the same kernel, each taking one piece away or changing one option (no GELU, no scale, bf16, other
compile options and graph passes), with the profiler's device time of each.

``python -m benchmarks.gpu_activation_quant [--tokens 4608] [--iters 50] [--json FILE]``  (needs CUDA;
``--smoke``: tiny shapes on the CPU, int8 weights, aot_eager)

With ``fp8_dynamic`` row scales, torchao quantizes each linear's input per row before its ``_scaled_mm``; under
compile, inductor fuses that (the row's amax, the division by its scale, the cast) with what produced the input.
In FLUX's single blocks that is the tanh-form GELU of the MLP branch concatenated with the attention output, 4,608
rows of 15,360: the kernel takes about 0.2 ms a call in a full step's profile, where reading and writing its bytes
once would take about 0.05. This compiles that projection with omnispec's compile options, in variants that each
take one piece away or change one option, and reads each kernel's device time from the profiler:

- ``gelu+quant``: ``proj_out(cat(attn, gelu(h)))``, as in the model (with omnispec's graph pass, which makes the
  kernel store the bf16 value between its loops; the row counts the values it routed);
- ``gelu+quant wide_stores``: the same without omnispec's pass (inductor then stores the float32 widening);
- ``gelu+quant fast_tanh``: the same with ``inductor_passes``' ``fast_tanh`` (the row counts its changes);
- ``gelu+quant no_eager_rounding``: the same without ``eager_rounding``;
- ``gelu+quant recompute`` (and ``fast_tanh``): the same with inductor's ``realize_opcount_threshold`` raised, so
  the GELU is computed in both loops instead of stored in float32 between them;
- ``gelu+quant timed`` / ``tuned``: the same with inductor timing its reduction launch configurations
  (``fixed_reductions: false``), and then also tuning them by coordinate descent;
- ``ff gelu+quant`` (and ``wide_stores``): a feed-forward's ``net[2](gelu(h))``, 12,288 wide, as in FLUX's double
  blocks (without omnispec's pass inductor stores nothing there and computes the GELU in both loops);
- ``quant``: ``proj_out(cat(attn, h))``, the quantization without the GELU;
- ``cast``: ``cat(attn, h)`` cast to fp8 with no scale at all (the same bytes in and out, no reduction);
- ``bf16 gelu``: ``proj_out(cat(attn, gelu(h)))`` on a bf16 weight (the GELU as a bf16 compile fuses it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from omnispec.kernels.inductor_passes import NarrowQuantizedInputs

from . import harness
from .inductor_passes import Passes

ATTN, MLP, OUT = 3072, 12288, 3072  # FLUX.1's single block: attention width, MLP width, proj_out's output
RECOMPUTE = {"realize_opcount_threshold": 200}  # above the GELU's operations with eager's roundings


def _projection(quantized: bool, smoke: bool, width: int = ATTN + MLP) -> torch.nn.Module:
    from torchao.quantization import quantize_

    from omnispec.policies.quantization import torchao_config

    width, out = (width, OUT) if not smoke else (width * 80 // (ATTN + MLP), 16)
    torch.manual_seed(0)
    proj = torch.nn.Linear(width, out, device=harness.DEVICE, dtype=torch.bfloat16)
    if quantized:  # the CPU has no fp8 matmul: the smoke quantizes int8 weights (no activation quantization)
        quantize_(proj, torchao_config("int8_weight_only") if smoke else torchao_config("fp8_dynamic", "row"))
    return proj


def _variants(smoke: bool) -> dict[str, tuple[Callable, dict]]:
    """name -> (function of (attn, h), compile policy fields and, under ``inductor``, extra inductor options)."""
    fp8, bf16, fp8_ff = _projection(True, smoke), _projection(False, smoke), _projection(True, smoke, MLP)
    gelu = torch.nn.GELU(approximate="tanh")
    cast_to = torch.int8 if smoke else torch.float8_e4m3fn

    def single_block(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return fp8(torch.cat([a, gelu(h)], -1))

    return {
        "gelu+quant": (single_block, {}),
        "gelu+quant wide_stores": (single_block, {"narrow": False}),
        "gelu+quant fast_tanh": (single_block, {"passes": ["fast_tanh"]}),
        "gelu+quant no_eager_rounding": (single_block, {"eager_rounding": False}),
        # inductor times each reduction kernel's candidate launch configurations at first launch, then also walks
        # its block sizes and warps one step at a time (coordinate descent): what a tuned launch shape is worth
        "gelu+quant timed": (single_block, {"fixed_reductions": False}),
        "gelu+quant tuned": (single_block, {"fixed_reductions": False,
                                            "inductor": {"coordinate_descent_tuning": True}}),
        "gelu+quant recompute": (single_block, {"inductor": RECOMPUTE}),
        "gelu+quant recompute fast_tanh": (single_block, {"inductor": RECOMPUTE, "passes": ["fast_tanh"]}),
        # the double blocks' feed-forward output (no concatenation): without omnispec's pass torch 2.11 recomputes the
        # GELU in both loops instead of storing anything; with it the kernel stores the bf16 GELU
        "ff gelu+quant": (lambda a, h: fp8_ff(gelu(h)), {}),
        "ff gelu+quant wide_stores": (lambda a, h: fp8_ff(gelu(h)), {"narrow": False}),
        "quant": (lambda a, h: fp8(torch.cat([a, h], -1)), {}),
        "cast": (lambda a, h: torch.cat([a, h], -1).to(cast_to), {}),
        "bf16 gelu": (lambda a, h: bf16(torch.cat([a, gelu(h)], -1)), {}),
    }


def _options(smoke: bool, passes: Passes, narrow: bool = True, inductor: dict | None = None,
             **policy: bool) -> tuple[str, dict]:
    """torch.compile's backend and inductor options for a compile policy with ``policy``'s fields, with
    ``inductor``'s options and ``passes`` on top (an experiment's, not the policy's), and without omnispec's own
    graph pass unless ``narrow``."""
    import torch._inductor.config as inductor_config

    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec.policies import CompilePolicy

    if smoke:  # inductor's CPU code generation takes minutes for the suite; the smoke checks the script
        return "aot_eager", {}
    experiment = passes if passes.names else None
    with inductor_config.patch(post_grad_custom_pre_pass=experiment):  # omnispec's pass chains what it finds here
        options = {**_torch_compile_options(CompilePolicy(mode="regional", **policy)), **(inductor or {})}
    if not narrow:
        options["post_grad_custom_pre_pass"] = experiment
    return "inductor", options


def measure(name: str, fn: Callable, policy: dict, inputs: tuple, iters: int, smoke: bool,
            unprofiled: bool = False) -> dict:
    policy = dict(policy)
    passes = Passes(policy.pop("passes", []))
    backend, options = _options(smoke, passes, **policy)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if harness.DEVICE == "cuda" else [])
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend, **({"options": options} if options else {}))
    with torch.no_grad():
        out = compiled(*inputs)
        reference = fn(*inputs)
        for _ in range(3):
            compiled(*inputs)
        harness.sync()
        if unprofiled:  # for an outside profiler (Nsight Compute), which torch's own would contend with
            start = time.perf_counter()
            for _ in range(iters):
                compiled(*inputs)
            harness.sync()
            summary = {"wall_ms_per_call": (time.perf_counter() - start) * 1e3 / iters}
        else:
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(iters):
                    compiled(*inputs)
                harness.sync()
            summary = harness.kernel_summary(prof, iters, "_per_call", largest=6)
    omnispec_pass = options.get("post_grad_custom_pre_pass")
    routed = {"omnispec": omnispec_pass.routed} if isinstance(omnispec_pass, NarrowQuantizedInputs) else {}
    row = {"config": name, **summary, "pass_changes": {**routed, **passes.applied}}
    if out.is_floating_point():
        a, b = out.float().flatten(), reference.float().flatten()
        row["cosine_vs_eager"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=4608, help="rows: FLUX.1 at 1024² has 4,096 image + 512 text")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    parser.add_argument("--unprofiled", action="store_true",
                        help="time the calls by the clock, without torch's profiler (to run under Nsight Compute)")


def benchmark(args, results: harness.Results) -> None:
    tokens, (attn_width, mlp_width) = (8, (16, 64)) if args.smoke else (args.tokens, (ATTN, MLP))
    results.header["tokens"] = tokens
    torch.manual_seed(1)
    attn = torch.randn(tokens, attn_width, device=harness.DEVICE, dtype=torch.bfloat16)
    h = torch.randn(tokens, mlp_width, device=harness.DEVICE, dtype=torch.bfloat16) * 2
    variants = _variants(args.smoke)
    wanted = [v for v in args.variants.split(",") if v] or list(variants)
    if unknown := set(wanted) - set(variants):
        raise harness.UsageError(f"--variants: unknown {sorted(unknown)}; choose from {sorted(variants)}")
    for name in wanted:
        fn, policy = variants[name]
        try:
            results.save(measure(name, fn, policy, (attn, h), args.iters, args.smoke, args.unprofiled))
        except Exception as exc:  # noqa: BLE001 - keep the other variants' rows
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            results.save({"config": name, "error": f"{type(exc).__name__}: {first_line}"})
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| config | device ms per call | by kind | graph pass changes |")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | error: {r['error'][:80]} | | |")
            continue
        if "wall_ms_per_call" in r:
            print(f"| {r['config']} | {r['wall_ms_per_call']:.3f} (wall) | | {r['pass_changes'] or ''} |")
            continue
        kinds = ", ".join(f"{kind} {ms:.3f}" for kind, ms in r["kinds_ms_per_call"].items())
        print(f"| {r['config']} | {r['device_busy_ms_per_call']:.3f} | {kinds} | {r['pass_changes'] or ''} |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU, int8 weights, aot_eager (checks the script only)")


if __name__ == "__main__":
    main()
