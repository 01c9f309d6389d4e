"""Can FLUX's feed-forward GELUs ride on the matmuls? The MLP pieces of a FLUX.1-dev 1024² step, alone.
Peer: kernel alternatives for the same arithmetic (diffusers' eager code, inductor's, cuBLASLt's GELU epilogue) and
the bare matmuls, the floor.

``python -m benchmarks.gpu_gemm_epilogue [--iters 50] [--json FILE]``  (needs CUDA; ``--smoke``: tiny shapes on the
CPU, aot_eager, without the cuBLASLt variants)

A compiled FLUX.1-dev step spends some 5.6 ms a step on two memory-bound kernels inductor writes after the matmuls
(BENCHMARKS.md, 2026-12-03): each single block's ``cat(attention, gelu(proj_mlp(x)))`` and each double block's
feed-forward GELU. cuBLASLt can apply a bias and GELU (tanh, FLUX's) in the matmul's epilogue, before the product
leaves the chip, and the single block's ``proj_out`` over the concatenation is the sum of two matmuls over its
halves, so neither the GELU nor the concatenation needs a pass of its own. This times, at FLUX.1-dev's shapes
(3,072 wide, 12,288 hidden, bf16):

- ``single block``: ``proj_out(cat(a, gelu(proj_mlp(x))))`` over 4,608 tokens;
- ``double block``: the feed-forward ``linear(gelu(linear(x)))`` over 4,096 image tokens;

in variants ``eager`` (diffusers' operations), ``inductor`` (the same compiled with omnispec's compile options,
which a compiled step runs now), ``epilogue`` (``torch._addmm_activation`` for the GELU, ``proj_out`` as two
accumulating matmuls over the weight's halves, no copy of it), ``omnispec op`` (the same through omnispec's
operators, ``policies.mlp.fused_gelu``'s, compiled) and ``matmuls`` (the same matmuls with nothing else: the floor).

Each row gives device microseconds per call (CUDA events over replays of the call recorded as a CUDA graph, the
median of five rounds) and the output's distance from eager's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import harness
from .harness import compiled
from .kernel_timing import measure_each, microseconds, table

WIDTH, HIDDEN, TEXT, IMAGE = 3072, 12288, 512, 4096  # FLUX.1 at 1024²


def _single_eager(x, a, w_mlp, b_mlp, w_out, b_out):
    g = F.gelu(F.linear(x, w_mlp, b_mlp), approximate="tanh")
    return F.linear(torch.cat([a, g], dim=-1), w_out, b_out)


def _double_eager(x, w_in, b_in, w_out, b_out):
    return F.linear(F.gelu(F.linear(x, w_in, b_in), approximate="tanh"), w_out, b_out)


def _single_epilogue(x, a, w_mlp, b_mlp, w_out, b_out):
    """The same arithmetic as omnispec's operators, called directly (no custom operator, uncompiled)."""
    from omnispec.kernels.gemm_epilogue import by_halves

    return by_halves(a, torch._addmm_activation(b_mlp, x, w_mlp.t(), use_gelu=True), w_out, b_out)


def _double_epilogue(x, w_in, b_in, w_out, b_out):
    return F.linear(torch._addmm_activation(b_in, x, w_in.t(), use_gelu=True), w_out, b_out)


def _single_matmuls(x, a, w_mlp, b_mlp, w_out, b_out):
    g = x @ w_mlp.t()
    return torch.cat([a, g], dim=-1) @ w_out.t() if False else (a @ w_out[:, :a.shape[-1]].t(),
                                                                 g @ w_out[:, a.shape[-1]:].t())


def _double_matmuls(x, w_in, b_in, w_out, b_out):
    return (x @ w_in.t()) @ w_out.t()


def _single_omnispec(x, a, w_mlp, b_mlp, w_out, b_out):
    from omnispec.kernels.gemm_epilogue import linear_gelu, linear_of_pair

    return linear_of_pair(a, linear_gelu(x, w_mlp, b_mlp), w_out, b_out)


def _double_omnispec(x, w_in, b_in, w_out, b_out):
    from omnispec.kernels.gemm_epilogue import linear_gelu

    return F.linear(linear_gelu(x, w_in, b_in), w_out, b_out)


def measure(shape: str, name: str, fn: Callable, inputs: tuple, reference: torch.Tensor, iters: int) -> dict:
    with torch.no_grad():
        for _ in range(3):  # compilation, the allocator
            out = fn(*inputs)
        rounds = microseconds(fn, inputs, iters, harness.DEVICE)
    row = {"shape": shape, "config": name, "us_per_call": statistics.median(rounds), "rounds_us": rounds}
    if name != "matmuls":
        got, want = out.float().flatten(), reference.float().flatten()
        row["max_abs_vs_eager"] = float((got - want).abs().max())
        row["share_differing_vs_eager"] = float((got != want).float().mean())
        row["cosine_vs_eager"] = float(F.cosine_similarity(got, want, dim=0))
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--iters", type=int, default=50)


def benchmark(args, results: harness.Results) -> None:
    width, hidden, text, image = (16, 64, 2, 6) if args.smoke else (WIDTH, HIDDEN, TEXT, IMAGE)
    iters = 2 if args.smoke else args.iters
    torch.manual_seed(0)
    dtype = torch.bfloat16

    def weight(rows, cols):
        return torch.randn(rows, cols, device=harness.DEVICE, dtype=dtype) / cols ** 0.5

    def bias(rows):
        return torch.randn(rows, device=harness.DEVICE, dtype=dtype) * 0.1

    def tokens(n):
        return torch.randn(n, width, device=harness.DEVICE, dtype=dtype)

    shapes = {
        "single block": ((tokens(text + image), tokens(text + image), weight(hidden, width), bias(hidden),
                          weight(width, width + hidden), bias(width)), _single_eager, _single_epilogue,
                         _single_omnispec, _single_matmuls),
        "double block": ((tokens(image), weight(hidden, width), bias(hidden), weight(width, hidden), bias(width)),
                         _double_eager, _double_epilogue, _double_omnispec, _double_matmuls),
    }
    for shape, (inputs, eager, epilogue, omnispec_op, matmuls) in shapes.items():
        with torch.no_grad():
            reference = eager(*inputs)
        variants: dict[str, Callable] = {"eager": eager, "inductor": compiled(eager)}
        if harness.DEVICE == "cuda":
            variants["epilogue"] = epilogue
        variants["omnispec op"] = compiled(omnispec_op)
        variants["matmuls"] = matmuls
        measure_each(shape, variants, lambda name, fn, shape=shape, inputs=inputs, reference=reference: measure(
            shape, name, fn, inputs, reference, iters), results.save)
    table(results.rows, {"us per call": lambda r: f"{r['us_per_call']:.1f}",
                         "max abs vs eager": lambda r: r.get("max_abs_vs_eager", ""),
                         "share differing": lambda r: r.get("share_differing_vs_eager", ""),
                         "cosine": lambda r: r.get("cosine_vs_eager", "")})


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU, aot_eager, without the cuBLASLt variants (checks the script "
                                "only)")


if __name__ == "__main__":
    main()
