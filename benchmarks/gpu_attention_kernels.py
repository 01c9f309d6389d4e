"""Which attention kernel is fastest at FLUX.1-dev 1024²'s shape on this GPU? The attention alone, kernel by kernel.
Peer: kernel alternatives at the same shape and layout (PyTorch's SDPA kernels, FlashAttention-4), each the others'.

``python -m benchmarks.gpu_attention_kernels [--tokens 4608] [--iters 50] [--json FILE]``  (needs CUDA; ``--smoke``:
tiny shapes on the CPU, the math kernel only)

A compiled FLUX.1-dev 1024² step spends about 25 ms of its ~125 in attention (57 blocks, one sequence of 4,608
tokens, 24 heads of 128, bf16), which cuDNN's kernel runs at ~580 TFLOP/s against a ~780 TFLOP/s matrix ceiling
(BENCHMARKS.md). Each row times one call at that shape, its inputs laid out as the model hands them over (each of
q, k, v a [batch, tokens, heads, dim] tensor, seen as [batch, heads, tokens, dim] by SDPA), for:

- ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``: PyTorch's SDPA kernels (cuDNN, FlashAttention-2,
  memory-efficient);
- ``sdpa_cudnn_bhsd``: cuDNN's kernel on inputs laid out [batch, heads, tokens, dim] in memory;
- ``fa4``: FlashAttention-4's CuTe kernels (``flash_attn.cute.flash_attn_func``, package ``flash-attn-4``), which
  on Hopper run its SM90 forward; absent packages give an error row;
- ``fa4_MxN`` (e.g. ``fa4_128x176``): FA4's forward at that tile instead of the one it picks.

Each row gives device milliseconds per call (CUDA events over replays of the call recorded as a CUDA graph, the
median of five rounds: a kernel that cannot be captured gives an error row, since a compiled step replays graphs),
TFLOP/s (4 · tokens² · heads · dim per call), the first call's seconds (a JIT kernel compiles there) and the relative
L2 distance of the output from float32 math attention on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import harness
from .kernel_timing import KERNEL_COLUMNS, kernel_row, labelled_variants, measure_each, table

SDPA = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}


def _sdpa(backend: SDPBackend, contiguous_heads: bool = False) -> Callable:
    """SDPA on ``backend``; ``contiguous_heads``: each input copied to [batch, heads, tokens, dim] first, outside
    the timed call (the layout a kernel writing q and k could hand over instead of the model's)."""
    def run(q, k, v):
        with sdpa_kernel([backend]):
            if contiguous_heads:
                return F.scaled_dot_product_attention(q, k, v)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)
    return run


def _fa4(tile: tuple[int, int] | None = None) -> Callable:
    """FA4's public function, or with ``tile`` (rows of q, rows of k/v a step) its private forward at that tile:
    the public one picks 128 x 128 on Hopper at head size 128, where FlashAttention-3's C++ kernel took 128 x 176."""
    from flash_attn.cute import flash_attn_func  # flash-attn-4; an ImportError is that row's error
    from flash_attn.cute.interface import _flash_attn_fwd

    def run(q, k, v):
        out = flash_attn_func(q, k, v) if tile is None else _flash_attn_fwd(q, k, v, tile_mn=tile)
        return out[0] if isinstance(out, tuple) else out
    return run


def _kernel(name: str) -> Callable:
    """``fa4``, ``fa4_MxN`` (FA4 at that tile) or an SDPA kernel's name, with ``_bhsd`` for the other layout."""
    if name == "fa4":
        return _fa4()
    if name.startswith("fa4_"):
        rows, cols = name.removeprefix("fa4_").split("x")
        return _fa4((int(rows), int(cols)))
    return _sdpa(SDPA[name.removesuffix("_bhsd")], contiguous_heads=name.endswith("_bhsd"))


def measure(name: str, fn: Callable, inputs: tuple, reference: torch.Tensor, iters: int, shape: str,
            clocks: bool = False) -> dict:
    batch, tokens, heads, dim = inputs[0].shape
    if name.split(" ")[0].endswith("_bhsd"):
        inputs, reference = tuple(x.transpose(1, 2).contiguous() for x in inputs), reference.transpose(1, 2)
    return kernel_row(shape, name, fn, inputs, reference, 4 * batch * tokens * tokens * heads * dim, iters=iters,
                      clocks=clocks)


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", default="4608", help="sequence lengths, comma-separated (4,608: FLUX at 1024²)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--kernels", default="sdpa_cudnn,sdpa_cudnn_bhsd,sdpa_flash,sdpa_efficient,fa4",
                        help="comma-separated; a name given again is timed again in that place (its row says which "
                             "time): under a power cap the clock falls as a run goes on, so alternate kernels")
    parser.add_argument("--clocks", action="store_true", help="sample the SM clock and power with nvidia-smi")


def benchmark(args, results: harness.Results) -> None:
    device = harness.DEVICE
    # the fast SDPA kernels and FA4 run on CUDA only
    kernels = ["sdpa_math", "sdpa_math_bhsd", "sdpa_math"] if args.smoke else args.kernels.split(",")
    heads, head_dim = (2, 16) if args.smoke else (args.heads, args.head_dim)
    token_counts = [24] if args.smoke else [int(t) for t in args.tokens.split(",")]
    iters = 2 if args.smoke else args.iters
    torch.manual_seed(0)
    for tokens in token_counts:
        shape = f"{args.batch}x{tokens}x{heads}x{head_dim}"
        inputs = tuple(torch.randn(args.batch, tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
                       for _ in range(3))
        # float32 attention as the reference; on CUDA the memory-efficient kernel, since the math kernel's score
        # matrix does not fit at a video model's length (2 x 40 heads x 32,760² floats: 343 GB)
        exact = SDPBackend.EFFICIENT_ATTENTION if device == "cuda" else SDPBackend.MATH
        with torch.no_grad():
            reference = _sdpa(exact)(*(x.float() for x in inputs))
        variants, errors = labelled_variants(shape, kernels, _kernel)
        for row in errors:
            results.save(row)
        measure_each(shape, variants, lambda name, fn, shape=shape, inputs=inputs, reference=reference: measure(
            name, fn, inputs, reference, iters, shape, args.clocks), results.save)
    table(results.rows, KERNEL_COLUMNS)


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU, the math kernel only (checks the script only)")


if __name__ == "__main__":
    main()
