"""Can FLUX's adaptive LayerNorms run at the memory's speed? Each block's norm and modulation, alone.
Peer: kernel alternatives for the same norm (diffusers' eager code, inductor under each compile option) and a plain
copy of one activation, the floor.

``python -m benchmarks.gpu_adaln_norm [--variants ...] [--iters 100] [--json FILE]``  (needs CUDA; ``--smoke``: tiny
shapes on the CPU, aot_eager)

In a compiled FLUX.1-dev 1024² step the largest of inductor's kernels is each single block's concatenation of the
two streams, LayerNorm and modulation: 57 µs a call, 2.2 ms a step, where its bytes move in about 20 µs at the 4.2
TB/s a plain copy reaches (BENCHMARKS.md, issue 27). Inductor writes a norm over 3,072 columns as a looped reduction
that reads each row twice. This times the three AdaLN places of FLUX's blocks at 1024² (bf16, the modulation rows
read from a table by index, as ``policies.mlp.precomputed_modulation`` gives them):

- ``single``: ``cat(text, image)`` (kept: the block's residual), normed, modulated;
- ``double norm1``: the image stream normed and modulated (``AdaLayerNormZero``);
- ``double norm2``: the gated attention output added to the image stream (kept), normed, modulated;

in variants: ``eager`` (diffusers' operations, the reference); ``inductor``, compiled with omnispec's compile options
(by default the norm reads its row once, ``persistent_rows`` 4,096), with compile policy fields after ``+``
(``+persistent_rows=1024``: inductor's own rule, the row read twice; ``+no_fixed_reductions``: inductor times its
reductions' launches); ``copy``, one activation cloned: the floor's rate.
Each row gives device microseconds per call (CUDA events over replays of the call recorded as a CUDA graph, the
median of five rounds), the bytes it must move (activations read once, outputs written once), their rate, and the
output's distance from eager's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from . import harness
from .kernel_timing import BANDWIDTH_COLUMNS, measure_each, microseconds, table

DIM, TEXT, IMAGE, STEPS = 3072, 512, 4096, 28  # FLUX.1-dev at 1024², 28 steps in the modulation table
EPS = 1e-6
DEFAULT_VARIANTS = ("eager,inductor+persistent_rows=1024,inductor,inductor+persistent_rows=1024+no_fixed_reductions,"
                    "inductor+no_fixed_reductions,copy")


def _modulation(table: torch.Tensor, rows: torch.Tensor, chunks: int) -> tuple[torch.Tensor, ...]:
    return table.index_select(0, rows).chunk(chunks, dim=1)


class SingleNorm(torch.nn.Module):
    """A single block's start (``FluxSingleTransformerBlock``): the streams joined, normed, modulated."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, text, image, table, rows):
        x = torch.cat([text, image], dim=1)
        shift, scale, gate = _modulation(table, rows, 3)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], x, gate


class DoubleNorm1(torch.nn.Module):
    """A double block's image-stream norm before attention (``AdaLayerNormZero``)."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, image, table, rows):
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = _modulation(table, rows, 6)
        return self.norm(image) * (1 + scale[:, None]) + shift[:, None], gate, shift_mlp, scale_mlp, gate_mlp


class DoubleNorm2(torch.nn.Module):
    """A double block's image stream after attention (``FluxTransformerBlock``): the gated attention output added,
    then the feed-forward's norm and modulation."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, image, attention, table, rows):
        _, _, gate, shift, scale, _ = _modulation(table, rows, 6)
        image = image + gate.unsqueeze(1) * attention
        return self.norm2(image) * (1 + scale[:, None]) + shift[:, None], image


MODULES = {"single": SingleNorm, "double norm1": DoubleNorm1, "double norm2": DoubleNorm2}


def _inputs(shape: str, text: int, image: int, dim: int) -> tuple:
    def tensor(tokens):
        return torch.randn(1, tokens, dim, device=harness.DEVICE, dtype=torch.bfloat16) * 3

    table = (torch.randn(STEPS, 6 * dim, device=harness.DEVICE) * 0.3).to(torch.bfloat16)
    rows = torch.tensor([5], device=harness.DEVICE)
    if shape == "single":
        return tensor(text), tensor(image), table[:, :3 * dim].contiguous(), rows
    if shape == "double norm1":
        return tensor(image), table, rows
    return tensor(image), tensor(image), table, rows


def _activations(inputs: tuple) -> list[torch.Tensor]:
    """The inputs a call reads whole (the table, of which it reads one row, and the row's index left out)."""
    return list(inputs[:-2])


def compiled(variant: str, smoke: bool) -> Callable:
    """A function compiling a module by ``variant``: ``inductor`` and compile policy options after ``+``, as
    the benchmarks' compile variants write them (``inductor+persistent_rows=1024+no_fixed_reductions``), through
    omnispec's inductor options (aot_eager for the CPU smoke, which checks the options and the script)."""
    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec import load_spec

    overrides = harness.compile_overrides("regional" + variant.removeprefix("inductor"))
    policy = load_spec(harness.ROOT / "specs" / "flux1-dev.yaml", overrides).policies.compile
    return lambda module: torch.compile(module, fullgraph=True, dynamic=False, **(
        {"backend": "aot_eager"} if smoke else {"options": _torch_compile_options(policy)}))


def _copy(*inputs):
    return inputs[0].clone()


def measure(shape: str, variant: str, module: Callable, inputs: tuple, reference: tuple, iters: int) -> dict:
    torch._dynamo.reset()  # a fresh compile under this variant's options, not another variant's cache entries
    with torch.no_grad():
        for _ in range(3):  # compilation, tuning at the first launch, the allocator
            out = module(*inputs)
        rounds = microseconds(module, inputs, iters, harness.DEVICE)
    out = out if isinstance(out, tuple) else (out,)
    read = _activations(inputs)[:1] if variant == "copy" else _activations(inputs)
    moved = sum(x.numel() * x.element_size() for x in (*read, *out))
    us = statistics.median(rounds)
    row = {"shape": shape, "config": variant, "us_per_call": us, "rounds_us": rounds, "bytes": moved,
           "tb_per_s": moved / us / 1e6}
    if variant != "copy":
        got = torch.cat([o.flatten() for o in out]).float()
        want = torch.cat([o.flatten() for o in reference]).float()
        row["max_abs_vs_eager"] = float((got - want).abs().max())
        row["share_differing_vs_eager"] = float((got != want).float().mean())
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated: eager, copy, inductor[+OPTION...], each OPTION a compile policy field "
                             "(persistent_rows=1024, no_fixed_reductions)")
    parser.add_argument("--iters", type=int, default=100)


def benchmark(args, results: harness.Results) -> None:
    text, image, dim = (2, 6, 16) if args.smoke else (TEXT, IMAGE, DIM)
    iters = 2 if args.smoke else args.iters
    torch.manual_seed(0)
    for shape, module_type in MODULES.items():
        inputs = _inputs(shape, text, image, dim)
        eager = module_type(dim).to(harness.DEVICE)
        with torch.no_grad():
            reference = eager(*inputs)

        def make(variant: str, module_type=module_type, eager=eager) -> Callable:
            if variant == "eager":
                return eager
            if variant == "copy":
                return _copy
            if variant.split("+")[0] != "inductor":
                raise ValueError(f"unknown variant {variant!r}: eager, copy or inductor[+OPTION...]")
            return compiled(variant, args.smoke)(module_type(dim).to(harness.DEVICE))

        variants = {name: make(name) for name in args.variants.split(",")}
        measure_each(shape, variants,
                     lambda name, fn, shape=shape, inputs=inputs, reference=reference:
                     measure(shape, name, fn, inputs, reference, iters), results.save)
    table(results.rows, BANDWIDTH_COLUMNS)


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU, aot_eager (checks the script only)")


if __name__ == "__main__":
    main()
