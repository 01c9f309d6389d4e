"""Could one grouped matmul do a FLUX double block's text and image projections? Those matmuls, alone.
Peer: kernel alternatives for the same rows (the two cuBLAS matmuls a step runs now, one dense matmul as the bound).

``python -m benchmarks.gpu_joint_gemm [--seconds 1.0] [--clocks] [--json FILE]``  (needs CUDA; ``--smoke``: tiny
shapes on the CPU)

A FLUX.1-dev double block projects its 512 text rows and its 4,096 image rows with weights of their own
(``add_q_proj`` and ``to_q``, ...). The text rows' matmuls are small and run at 390-650 TFLOP/s where the image rows'
run at ~745: about 3.5 ms of a compiled 1024² step (the profile of BENCHMARKS.md, 2026-12-04). Before a policy
groups them, this times them alone, for an attention projection (3,072 -> 3,072) and the feed-forward's output
(12,288 -> 3,072), the rows joint (text first, as attention takes them), bf16:

- ``two matmuls``: cuBLAS (``torch.addmm``) for each stream, each writing its rows of the joint output: the two
  launches a step runs now;
- ``grouped``: ``torch._grouped_mm`` over the joint rows with the two weights stacked, then the biases added (it
  takes none): one matmul launch and a pointwise pass;
- ``grouped, no bias``: its matmul alone, what a build adding the biases inside a later kernel would pay;
- ``one matmul``: all rows through one weight (cuBLAS): the same FLOPs in one dense launch, the bound.

Each row: device ms per call (CUDA events over replays of the call recorded as a CUDA graph, median of five rounds
of ``--seconds`` each, long enough for the clock to settle at the power cap), TFLOP/s, and the relative L2 distance
from a float32 computation of the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import harness
from .kernel_timing import KERNEL_COLUMNS, kernel_row, measure_each, table

TEXT, IMAGE = 512, 4096  # FLUX.1 at 1024²
SHAPES = {"attention projection": (3072, 3072), "feed-forward output": (12288, 3072)}  # (inner, outputs)


def variants(text: int, ends: torch.Tensor) -> dict[str, Callable]:
    """The ways to compute the joint rows' projections, the first ``text`` rows by the first weight. ``ends``: the
    groups' end rows (int32, on the device) for ``torch._grouped_mm``, made before the timing records its graph,
    since a graph being recorded cannot copy from the host."""
    def two_matmuls(x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weights.shape[1])
        for rows, weight, bias in zip((slice(0, text), slice(text, None)), weights, biases, strict=True):
            torch.addmm(bias, x[rows], weight.t(), out=out[rows])
        return out

    def grouped(bias: bool) -> Callable:
        def run(x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
            out = torch._grouped_mm(x, weights.transpose(1, 2), offs=ends)
            if bias:
                out[:text] += biases[0]
                out[text:] += biases[1]
            return out
        return run

    def one_matmul(x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[1], biases[1])

    return {"two matmuls": two_matmuls, "grouped": grouped(True), "grouped, no bias": grouped(False),
            "one matmul": one_matmul}


def reference(name: str, text: int, x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """What variant ``name`` computes, in float32."""
    x, weights, biases = x.float(), weights.float(), biases.float()
    if name == "one matmul":
        return F.linear(x, weights[1], biases[1])
    keep = name != "grouped, no bias"
    return torch.cat([F.linear(x[:text], weights[0], biases[0] if keep else None),
                      F.linear(x[text:], weights[1], biases[1] if keep else None)])


def add_arguments(parser) -> None:
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each of the five timed rounds")
    parser.add_argument("--clocks", action="store_true", help="sample the SM clock and power with nvidia-smi")


def benchmark(args, results: harness.Results) -> None:
    device = harness.DEVICE
    text = 16 if args.smoke else TEXT
    torch.manual_seed(0)
    for shape, (inner, outputs) in SHAPES.items():
        tokens = 48 if args.smoke else TEXT + IMAGE
        if args.smoke:
            inner, outputs = inner // 192, outputs // 192
        inputs = (torch.randn(tokens, inner, device=device, dtype=torch.bfloat16),
                  torch.randn(2, outputs, inner, device=device, dtype=torch.bfloat16) / inner ** 0.5,
                  torch.randn(2, outputs, device=device, dtype=torch.bfloat16) * 0.1)
        flops = 2 * tokens * inner * outputs
        ends = torch.tensor([text, tokens], device=device, dtype=torch.int32)
        measure_each(shape, variants(text, ends), lambda name, fn, shape=shape, inputs=inputs, flops=flops: kernel_row(
            shape, name, fn, inputs, reference(name, text, *inputs), flops,
            seconds=0.01 if args.smoke else args.seconds, clocks=args.clocks), results.save)
    table(results.rows, KERNEL_COLUMNS)


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
