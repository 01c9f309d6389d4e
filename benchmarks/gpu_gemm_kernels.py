"""Which matmul kernel does FLUX.1-dev's step best at the power cap? Its largest matmuls alone, kernel by kernel.
Peer: kernel alternatives for the same call (cuBLAS as torch runs it, quack's CuTe GEMMs, cuBLASLt's other algorithms).

``python -m benchmarks.gpu_gemm_kernels [--seconds 1.0] [--kernels ...] [--json FILE]``  (needs CUDA; ``--smoke``:
tiny shapes on the CPU, torch's matmul only; the ``quack`` rows need ``quack-kernels``, which ``omnispec[flash4]``
brings, the ``lt`` rows ``nvmath-python``, which loads the cuBLAS torch's wheel installed)

A compiled FLUX.1-dev 1024² step runs at the H200's 700 W cap (its SM clock ~1,600 MHz, not the 1,980 a short
kernel gets), and some 85 of its ~125 ms are cuBLAS's matmuls (BENCHMARKS.md, 2026-12-04). So what a kernel costs
in a step is its time at the capped clock, which a benchmark of a few calls does not show: FlashAttention-4 is 4%
slower than cuDNN's attention in a short run and 5% faster in a long one. This times the step's three matmul kinds
(bf16, bias; 4,608 tokens, 3,072 wide, 12,288 hidden) in rounds of ``--seconds`` each, long enough for the clock
to settle where the power cap puts it:

- ``proj_mlp + gelu``: a single block's ``gelu(proj_mlp(x))``, 4,608 x 3,072 -> 12,288, GELU (tanh) in the epilogue;
- ``proj_out``: a single block's output projection, 4,608 x 15,360 -> 3,072;
- ``to_q``: one of the attention projections, 4,608 x 3,072 -> 3,072;
- ``ff + gelu``: a double block's image feed-forward up to its GELU, 4,096 x 3,072 -> 12,288;

with kernels ``cublas`` (``F.linear``; for the GELU row cuBLASLt's bias+GELU epilogue, ``torch._addmm_activation``,
which ``policies.mlp.fused_gelu`` runs now) and ``quack`` (the CuTe DSL GEMMs of ``quack-kernels``, which
FlashAttention-4 brings along: its Hopper kernel at its default tile, 128 x 192 ping-pong in clusters of 2),
``quack_128x256``, ``quack_256x128`` and ``quack_256x192`` (its cooperative kernel at those tiles), and ``lt0``,
``lt1``, ... (cuBLASLt's algorithms for the same call in the order of its own heuristic, run through nvmath-python,
which can hand cuBLASLt an algorithm of the caller's choice: torch always takes the heuristic's first, ``lt0``, and
that heuristic ranks by a short run at the peak clock, as FlashAttention-4's tiles were chosen). A name given again
is timed again in that place (the clock drifts as a run goes on: alternate kernels).

``cublas_full_reduction`` is ``cublas`` with torch's ``allow_bf16_reduced_precision_reduction`` off, which narrows
the reduction schemes torch lets cuBLASLt choose from.

Each row: device ms per call (CUDA events over replays of the call recorded as a CUDA graph, median of five
rounds), TFLOP/s, the relative L2 distance from a float32 matmul on the same inputs, and with ``--clocks`` the
median SM clock and board power nvidia-smi read during the timed rounds; ``lt`` rows also the algorithm's tile,
stages, cluster shape and split-K as nvmath reports them. ``--memsets`` adds what the profiler's trace shows of the
recorded call: the memsets cuBLAS puts into a graph ahead of its kernel (a compiled FLUX step's profile has one
before each of its 248 matmuls, and a gap after it), their bytes and device time, and the kernels, per call.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from . import harness
from .kernel_timing import KERNEL_COLUMNS, kernel_row, labelled_variants, measure_each, table

TOKENS, WIDTH, HIDDEN = 4608, 3072, 12288  # FLUX.1 at 1024²: 4,096 image + 512 text tokens
# (rows, inner, outputs, GELU in the epilogue)
SHAPES = {"proj_mlp + gelu": (TOKENS, WIDTH, HIDDEN, True), "proj_out": (TOKENS, WIDTH + HIDDEN, WIDTH, False),
          "to_q": (TOKENS, WIDTH, WIDTH, False), "ff + gelu": (TOKENS - 512, WIDTH, HIDDEN, True)}
QUACK_TILES = {"quack_128x256": (128, 256), "quack_256x128": (256, 128), "quack_256x192": (256, 192)}


def _cublas(gelu: bool) -> Callable:
    if gelu:
        return lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return F.linear


def _quack(gelu: bool, tile: tuple[int, int] | None) -> Callable:
    """quack's SM90 GEMM; ``tile`` (m, n) picks its cooperative kernel at that tile, None its default config."""
    from quack.gemm_config import GemmConfig  # quack-kernels; an ImportError is that row's error
    from quack.gemm_interface import gemm, gemm_act, gemm_act_tuned, gemm_tuned

    config = None if tile is None else GemmConfig(tile_m=tile[0], tile_n=tile[1], pingpong=False, cluster_m=2,
                                                  cluster_n=1, is_dynamic_persistent=False, device_capacity=9)
    if gelu:
        if config is None:
            return lambda x, w, b: gemm_act(x, w.t(), bias=b, activation="gelu_tanh_approx", store_preact=False,
                                            tuned=False)[1]

        def act(x, w, b):
            out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
            gemm_act_tuned.fn(x, w.t(), None, out, bias=b, activation="gelu_tanh_approx", config=config)
            return out
        return act
    if config is None:
        return lambda x, w, b: gemm(x, w.t(), bias=b, tuned=False)

    def plain(x, w, b):
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        gemm_tuned.fn(x, w.t(), out, bias=b, config=config)
        return out
    return plain


def _cublaslt(gelu: bool, rank: int) -> Callable:
    """cuBLASLt's ``rank``-th algorithm (by its heuristic) for ``x @ w.T + b`` (then GELU), the problem torch's
    ``F.linear`` hands it: nvmath-python plans the call once for the inputs it first sees and runs that algorithm.
    cuBLASLt's bias runs along the output's column-major rows, so the call is ``w @ x.T`` into a column-major result
    (``c`` sets the result's layout; ``beta=0`` so it is not read): the memory torch's call writes."""
    from nvmath.linalg.advanced import Matmul, MatmulEpilog  # nvmath-python; an ImportError is that row's error

    plans: dict[tuple, tuple] = {}

    def run(x, w, b):
        key = (x.data_ptr(), w.data_ptr(), b.data_ptr())
        if key not in plans:
            layout = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype).t()
            matmul = Matmul(w, x.t(), c=layout, beta=0.0)
            algorithms = matmul.plan(preferences={"limit": rank + 1}, epilog_inputs={"bias": b},
                                     epilog=MatmulEpilog.GELU_BIAS if gelu else MatmulEpilog.BIAS)
            if rank >= len(algorithms):
                raise ValueError(f"cuBLASLt's heuristic offers {len(algorithms)} algorithms for this call")
            algorithm = algorithms[rank]
            run.details = {name: str(getattr(algorithm, name, "")) for name in
                           ("algorithm_id", "tile", "stages", "cluster_shape", "split_k", "cta_swizzling")}
            plans[key] = (matmul, algorithm)
        matmul, algorithm = plans[key]
        return matmul.execute(algorithm=algorithm).t()
    return run


def _full_reduction(fn: Callable) -> Callable:
    """``fn`` with ``allow_bf16_reduced_precision_reduction`` off while it runs (a CUDA graph records the choice
    cuBLAS makes then)."""
    def run(*inputs):
        flags = torch.backends.cuda.matmul
        before, flags.allow_bf16_reduced_precision_reduction = flags.allow_bf16_reduced_precision_reduction, False
        try:
            return fn(*inputs)
        finally:
            flags.allow_bf16_reduced_precision_reduction = before
    return run


def memsets(fn: Callable, inputs: tuple, calls: int = 4) -> dict:
    """The device's work for one call of ``fn`` recorded as a CUDA graph, from the profiler's trace of ``calls``
    replays: memsets (count, bytes, microseconds) and kernels. (The gaps between them are left out: in a graph of
    one matmul the trace puts 20-36 µs between the memset and the kernel, where a step's profile has ~2 µs.)"""
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    sets = [e for e in events if e.get("cat") == "gpu_memset"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return {"memsets_per_call": len(sets) / calls,
            "memset_bytes": sorted({e.get("args", {}).get("bytes", -1) for e in sets}),
            "memset_us_per_call": sum(e["dur"] for e in sets) / calls,
            "kernels_per_call": len(kernels) / calls, "kernels": sorted({e["name"][:80] for e in kernels})}


def kernel(name: str, gelu: bool) -> Callable:
    if name == "cublas_full_reduction":
        return _full_reduction(_cublas(gelu))
    if name.startswith("lt") and name[2:].isdigit():
        return _cublaslt(gelu, int(name[2:]))
    if name == "cublas":
        return _cublas(gelu)
    if name == "quack":
        return _quack(gelu, None)
    if name in QUACK_TILES:
        return _quack(gelu, QUACK_TILES[name])
    raise ValueError(f"unknown kernel {name!r}: cublas, cublas_full_reduction, quack, {', '.join(QUACK_TILES)}, "
                     "lt0, lt1, ...")


def measure(shape: str, name: str, fn: Callable, inputs: tuple, reference: torch.Tensor, seconds: float,
            clocks: bool, with_memsets: bool = False) -> dict:
    (rows, inner), outputs = inputs[0].shape, inputs[1].shape[0]
    row = kernel_row(shape, name, fn, inputs, reference, 2 * rows * inner * outputs, seconds=seconds, clocks=clocks)
    if with_memsets:
        try:
            row = {**row, **memsets(fn, inputs)}
        except Exception as exc:  # noqa: BLE001 - the row's timing stands without its trace
            row = {**row, "memsets_error": f"{type(exc).__name__}: {exc}"}
    return {**row, **getattr(fn, "details", {})}


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--kernels", default="cublas,quack,cublas,quack_128x256,cublas,quack_256x128",
                        help="comma-separated; a name given again is timed again in that place")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each of the five timed rounds")
    parser.add_argument("--clocks", action="store_true", help="sample the SM clock and power with nvidia-smi")
    parser.add_argument("--memsets", action="store_true",
                        help="profile each recorded call: its memsets and kernels (CUDA only)")


def benchmark(args, results: harness.Results) -> None:
    device = harness.DEVICE
    kernels = ["cublas", "cublas_full_reduction"] if args.smoke else args.kernels.split(",")  # quack: CUDA only
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        tokens, inner, outputs, gelu = SHAPES[shape]
        if args.smoke:
            tokens, inner, outputs = 24, inner // 192, outputs // 192
        inputs = (torch.randn(tokens, inner, device=device, dtype=torch.bfloat16),
                  torch.randn(outputs, inner, device=device, dtype=torch.bfloat16) / inner ** 0.5,
                  torch.randn(outputs, device=device, dtype=torch.bfloat16) * 0.1)
        with torch.no_grad():
            reference = F.linear(*(t.float() for t in inputs))
            if gelu:
                reference = F.gelu(reference, approximate="tanh")
        variants, errors = labelled_variants(shape, kernels, lambda name, gelu=gelu: kernel(name, gelu))
        for row in errors:
            results.save(row)
        measure_each(shape, variants, lambda name, fn, shape=shape, inputs=inputs, reference=reference: measure(
            shape, name, fn, inputs, reference, 0.01 if args.smoke else args.seconds, args.clocks,
            args.memsets and not args.smoke), results.save)
    columns = dict(KERNEL_COLUMNS)
    if args.memsets:
        columns |= {"memsets": lambda r: r.get("memsets_per_call", ""),
                    "memset bytes": lambda r: r.get("memset_bytes", ""),
                    "memset us": lambda r: r.get("memset_us_per_call", ""),
                    "kernels": lambda r: r.get("kernels_per_call", "")}
    table(results.rows, columns)


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU, torch's matmul only (checks the script only)")


if __name__ == "__main__":
    main()
