"""Can FLUX's q/k RMS norms and RoPE run at the memory's speed? The attention's input preparation, alone.
Peer: kernel alternatives for the same preparation (diffusers' eager code, inductor's, omnispec's Triton kernel) and
a plain copy of the same bytes, the floor.

``python -m benchmarks.gpu_norm_rope [--iters 100] [--json FILE]``  (needs CUDA; ``--smoke``: tiny shapes on the
CPU, aot_eager, without the Triton kernel)

In a compiled FLUX.1-dev 1024² step inductor fuses each single block's q/k RMS norms with the interleaved RoPE into
one looped reduction that moved its bytes at 1.2 TB/s, where a plain cast reaches 4.2 (BENCHMARKS.md, 2026-12-03).
This times that preparation at the single block's shapes (one sequence of 4,608 tokens) and the double block's
(512 text tokens normed with their own weights, then 4,096 image tokens, concatenated before the RoPE), 24 heads of
128, bf16, in variants:

- ``eager``: diffusers' own code (``torch.nn.RMSNorm``, ``apply_rotary_emb``), uncompiled: the reference;
- ``inductor``: the same compiled with omnispec's compile options (what a compiled step runs now);
- ``inductor pairs``: the same arithmetic written on (even, odd) pairs instead of ``stack``/``unbind``;
- ``triton TxHxW``: omnispec's kernel (``policies.attention.fused_qk_norm_rope``: the norm, eager's rounding, the
  RoPE, one read, one write) preparing q and k in one launch, each program taking T tokens of H heads of each with W
  warps (``--triton-configs``; omnispec launches 16x4x4); ``per tensor``: the first shape with one launch for q and one
  for k, which weighs the pairing;
- ``copy``: q and k copied, the same bytes once each way: the floor.

Each row gives device microseconds per call (CUDA events over replays of the call recorded as a CUDA graph, the
median of five rounds), the bytes a call must move, their rate, and the output's distance from eager's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from diffusers.models.embeddings import apply_rotary_emb

from . import harness
from .harness import compiled
from .kernel_timing import BANDWIDTH_COLUMNS, measure_each, microseconds, table

HEADS, HEAD_DIM, TEXT, IMAGE = 24, 128, 512, 4096  # FLUX.1 at 1024²
EPS = 1e-6


class NormRope(torch.nn.Module):
    """FLUX attention's preparation of q and k as diffusers writes it (``FluxAttnProcessor``): RMS norms per head,
    the text stream's with their own weights and put first, then the interleaved RoPE over the whole sequence."""

    def __init__(self, head_dim: int, pairs: bool = False):
        super().__init__()
        self.pairs = pairs
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            norm = torch.nn.RMSNorm(head_dim, eps=EPS)
            torch.nn.init.normal_(norm.weight, 1.0, 0.1)
            setattr(self, name, norm)

    def forward(self, q, k, cos, sin, text_q=None, text_k=None):
        q, k = self.norm_q(q), self.norm_k(k)
        if text_q is not None:
            q = torch.cat([self.norm_added_q(text_q), q], dim=1)
            k = torch.cat([self.norm_added_k(text_k), k], dim=1)
        if self.pairs:
            return _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
        return apply_rotary_emb(q, (cos, sin), sequence_dim=1), apply_rotary_emb(k, (cos, sin), sequence_dim=1)


def _rope_pairs(x, cos, sin):
    """``apply_rotary_emb``'s arithmetic (float32 products, one rounding) on (even, odd) pairs."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos_even, cos_odd = cos[None, :, None, :].unflatten(-1, (-1, 2)).unbind(-1)
    sin_even, sin_odd = sin[None, :, None, :].unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd], dim=-1).flatten(-2).to(
        x.dtype)


def _triton_norm_rope(module: NormRope, tokens_per_program: int, heads_per_program: int, warps: int,
                      paired: bool) -> Callable:
    """omnispec's fused operator's Triton kernel (``kernels.qk_norm_rope``) at a given launch shape, q and k in one
    launch or one each."""
    from omnispec.kernels.qk_norm_rope import launch

    shape = {"tokens_per_program": tokens_per_program, "heads_per_program": heads_per_program, "warps": warps}

    def run(q, k, cos, sin, text_q=None, text_k=None):
        return launch(q, k, module.norm_q.weight, module.norm_k.weight, module.norm_q.eps, cos, sin, text_q, text_k,
                      module.norm_added_q.weight, module.norm_added_k.weight, paired=paired, **shape)

    return run


def _copy(q, k, cos, sin, text_q=None, text_k=None):
    return tuple(x.clone() for x in (q, k, text_q, text_k) if x is not None)


def measure(shape: str, name: str, fn: Callable, inputs: tuple, reference: tuple, iters: int) -> dict:
    with torch.no_grad():
        for _ in range(3):  # compilation, autotuning, the allocator
            out = fn(*inputs)
        rounds = microseconds(fn, inputs, iters, harness.DEVICE)
    q, k = inputs[0], inputs[1]
    moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * inputs[2].numel() * inputs[2].element_size()
    if len(inputs) > 4:
        moved += 2 * (inputs[4].numel() + inputs[5].numel()) * q.element_size()
    us = statistics.median(rounds)
    row = {"shape": shape, "config": name, "us_per_call": us, "rounds_us": rounds, "bytes": moved,
           "tb_per_s": moved / us / 1e6}
    if name != "copy":
        got, want = torch.cat([o.flatten() for o in out]).float(), torch.cat([o.flatten() for o in reference]).float()
        row["max_abs_vs_eager"] = float((got - want).abs().max())
        row["share_differing_vs_eager"] = float((got != want).float().mean())
        row["cosine_vs_eager"] = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--triton-configs", default="16x4x4,16x2x4,32x2x8",
                        help="the Triton kernel's launch shapes, comma-separated: tokens x heads per program (of q and "
                             "of k each) x warps; the first is also timed with one launch per tensor")


def benchmark(args, results: harness.Results) -> None:
    heads, head_dim, text, image = (2, 16, 2, 6) if args.smoke else (HEADS, HEAD_DIM, TEXT, IMAGE)
    iters = 2 if args.smoke else args.iters
    torch.manual_seed(0)
    dtype = torch.bfloat16

    def tensor(tokens):
        return torch.randn(1, tokens, heads, head_dim, device=harness.DEVICE, dtype=dtype) * 3

    angles = torch.rand(text + image, head_dim // 2, device=harness.DEVICE) * 6.3
    cos, sin = (f(angles).repeat_interleave(2, dim=1).contiguous() for f in (torch.cos, torch.sin))
    shapes = {"single block": (tensor(text + image), tensor(text + image), cos, sin),
              "double block": (tensor(image), tensor(image), cos, sin, tensor(text), tensor(text))}
    module = NormRope(head_dim).to(harness.DEVICE, dtype)
    pairs = NormRope(head_dim, pairs=True).to(harness.DEVICE, dtype)
    pairs.load_state_dict(module.state_dict())
    variants: dict[str, Callable] = {"eager": module, "inductor": compiled(module)}
    variants["inductor pairs"] = compiled(pairs)
    if harness.DEVICE == "cuda":
        for i, config in enumerate(args.triton_configs.split(",")):
            tokens, heads_per_program, warps = (int(n) for n in config.split("x"))
            variants[f"triton {config}"] = _triton_norm_rope(module, tokens, heads_per_program, warps, True)
            if i == 0:  # the first shape also with one launch per tensor
                variants[f"triton {config} per tensor"] = _triton_norm_rope(module, tokens, heads_per_program,
                                                                            warps, False)
    variants["copy"] = _copy
    for shape, inputs in shapes.items():
        with torch.no_grad():
            reference = module(*inputs)
        measure_each(shape, variants, lambda name, fn, shape=shape, inputs=inputs, reference=reference: measure(
            shape, name, fn, inputs, reference, iters), results.save)
    table(results.rows, BANDWIDTH_COLUMNS)


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark,
                          smoke="tiny shapes on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
