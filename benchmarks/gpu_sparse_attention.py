"""How much faster is a video's self-attention on sparse layouts than dense? One attention call, at real grids.
Peer: dense attention on torch's flash kernel (what a dense step runs) and on FlexAttention without a mask.

``python -m benchmarks.gpu_sparse_attention [--iters 20] [--shapes wan14b_480p,ltx2_video] [--kept-only]
[--json FILE]``  (needs CUDA; ``--smoke``: a tiny grid on the CPU; ``--kept-only``: each layout's fraction of blocks
kept and the time and memory of building its block mask, nothing timed on attention, on any device: the fractions
do not depend on it)

Each row is one layout of ``policies.attention.sparse`` (``kernels.sparse_video``: tokens in tile-major order, a
FlexAttention block mask, the output put back in order) at the token grid and heads of a model's video
self-attention, bf16, batch 1: milliseconds per call (CUDA events, median of five rounds of ``--iters`` calls, after
a warm-up that compiles FlexAttention), the speed-up over the dense flash call, the fraction of (query, key) blocks
the layout computes, and the cosine of its output against the dense output. The inputs are random, whose attention
is nearly uniform, so this cosine is a floor; the quality of a layout on a model is the cosine of a step's prediction
(``benchmarks.gpu_interpreter --workloads wan --also 'policies.attention.sparse={...}'`` times the whole step).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import harness

# (frames, height, width) of the token grid, heads, head size
SHAPES = {
    "wan14b_480p": ((21, 30, 52), 40, 128),  # Wan2.1 14B, 480x832x81: 21 latent frames of 60x104, 1x2x2 patches
    "ltx2_video": ((16, 16, 24), 32, 128),  # LTX-2 19B video_self, 512x768x121: 16 latent frames of 16x24
}
# (kind, tile, window): tiles of 128 tokens fill FlexAttention's blocks
LAYOUTS = {
    "sliding_tile 2x8x8 w1x1x1": ("sliding_tile", (2, 8, 8), (1, 1, 1)),
    "sliding_tile 2x8x8 w2x2x2": ("sliding_tile", (2, 8, 8), (2, 2, 2)),
    "radial 1x8x16 w1x1x1": ("radial", (1, 8, 16), (1, 1, 1)),
}


def add_arguments(parser) -> None:
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kept-only", action="store_true",
                        help="only each layout's blocks kept and its block mask's build (seconds, peak memory)")


def _milliseconds(fn, iters: int, device: str) -> float:
    fn()  # warm-up: compiles FlexAttention for this shape and mask
    rounds = []
    for _ in range(5):
        harness.sync()
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        harness.sync()
        rounds.append((time.perf_counter() - begin) * 1e3 / iters)
    return statistics.median(rounds)


def benchmark(args, results: harness.Results) -> None:
    from omnispec.kernels.sparse_video import kept_fraction, layout
    from torch.nn.attention.flex_attention import flex_attention

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    iters = 1 if args.smoke else args.iters
    shapes = {"tiny": ((3, 8, 8), 2, 16)} if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    layouts = {"sliding_tile 1x4x4 w0x1x1": ("sliding_tile", (1, 4, 4), (0, 1, 1)),
               "radial 1x4x4 w0x1x1": ("radial", (1, 4, 4), (0, 1, 1))} if args.smoke else LAYOUTS
    if args.kept_only:
        results.header = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                          "torch": torch.__version__}
        _kept_rows(shapes, layouts, device, results)
        return
    results.header = {"device": harness.device_name(), "torch": torch.__version__}
    flex = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention
    for shape, (grid, heads, head_dim) in shapes.items():
        n = grid[0] * grid[1] * grid[2]
        generator = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, generator=generator)
                   for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH):
            dense = F.scaled_dot_product_attention(q, k, v)
            flash_ms = _milliseconds(lambda: F.scaled_dot_product_attention(q, k, v), iters, device)
        results.save({"shape": shape, "tokens": n, "config": "dense flash", "ms": flash_ms, "speedup": 1.0})
        results.save({"shape": shape, "tokens": n, "config": "dense flex",
                      "ms": (ms := _milliseconds(lambda: flex(q, k, v), iters, device)), "speedup": flash_ms / ms})
        for name, (kind, tile, window) in layouts.items():
            try:
                video = layout(kind, grid, tile, window, torch.device(device))
                out = video.attend(q, k, v)
                ms = _milliseconds(lambda: video.attend(q, k, v), iters, device)
                cosine = F.cosine_similarity(out.float().flatten(), dense.float().flatten(), dim=0).item()
                results.save({"shape": shape, "tokens": n, "config": name, "ms": ms, "speedup": flash_ms / ms,
                              "kept": kept_fraction(video), "cosine_random_inputs": cosine})
            except Exception as exc:  # noqa: BLE001 - a layout that cannot run is a row of its own
                results.save({"shape": shape, "config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        harness.free_device_memory()


def _kept_rows(shapes: dict, layouts: dict, device: str, results: harness.Results) -> None:
    """Each layout's fraction of blocks kept, with its build's seconds and the process's peak memory after it (the
    device's on CUDA, resident on the CPU)."""
    import resource

    from omnispec.kernels.sparse_video import kept_fraction, layout

    for shape, (grid, _, _) in shapes.items():
        for name, (kind, tile, window) in layouts.items():
            begin = time.perf_counter()
            video = layout(kind, grid, tile, window, torch.device(device))
            if device == "cuda":
                torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() if device == "cuda"
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            results.save({"shape": shape, "tokens": video.tokens, "config": name, "kept": kept_fraction(video),
                          "build_s": time.perf_counter() - begin, "peak_memory_gib": peak / 2**30})


if __name__ == "__main__":
    harness.run_benchmark(__doc__, add_arguments, benchmark)
