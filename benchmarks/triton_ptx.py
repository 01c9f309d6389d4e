"""What omnispec's Triton kernel (``kernels.qk_norm_rope``) compiles to for a GPU, on a machine without one.
No peer: facts of one kernel's code (registers, spills, load and store widths) per launch shape, to read, not time.

``python -m benchmarks.triton_ptx [--arch 90] [--configs 16x4x4,16x2x4] [--json FILE]``  (needs triton, whose wheel
carries the ptxas that gives registers and spills)

A memory-bound kernel moves its bytes at the memory's speed only when each thread loads and stores 16 bytes an
instruction. Triton decides that from what it can prove about a pointer's contiguity and alignment, and releases
differ: the kernel's first form, which chose the head stride (the text stream's or the image stream's) per token,
compiled to 16-byte loads under triton 3.6 and 3.7.1 (torch 2.11's and 2.13's) and to 2-byte loads under 3.9
(BENCHMARKS.md, 2026-12-05). This compiles the kernel as a launch at FLUX's shapes specializes it (every pointer and
integer argument divisible by 16; bf16 tensors, float32 angles) and reports, per launch shape and for q and k in one
launch or one launch each: registers, spilled bytes, and the global loads and stores by width.
"""

from __future__ import annotations

from . import harness
from .kernel_timing import compiled_facts

CONSTEXPRS = ("TOKENS", "HEADS", "D", "PAIRED")
HEAD_DIM = 128  # FLUX's


def _argument_type(name: str) -> str:
    """The type a launch at FLUX's shapes gives the kernel's argument ``name``."""
    if name in CONSTEXPRS:
        return "constexpr"
    if name == "eps":
        return "fp32"
    if name in ("tokens", "first_tokens") or name.endswith(("_sb", "_st", "_sh")):
        return "i32"
    return "*fp32" if name in ("cos", "sin") else "*bf16"


def compile_kernel(arch: int, tokens: int, heads: int, warps: int, paired: bool) -> dict:
    """The kernel compiled for ``sm_<arch>`` at a launch shape (``compiled_facts``)."""
    import triton

    from omnispec.kernels.qk_norm_rope_triton import qk_norm_rope_kernel as kernel

    signature = {name: _argument_type(name) for name in kernel.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name] not in ("constexpr", "fp32")}
    constants = {"TOKENS": tokens, "HEADS": heads, "D": HEAD_DIM, "PAIRED": paired}
    return {"config": f"{tokens}x{heads}x{warps}", "paired": paired, "arch": f"sm_{arch}", "triton": triton.__version__,
            **compiled_facts(kernel, signature, constants, divisible, arch,
                             {"num_warps": warps, "enable_fp_fusion": False})}


def add_arguments(parser) -> None:
    parser.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (90: H100/H200)")
    parser.add_argument("--configs", default="16x4x4,16x2x4",
                        help="launch shapes, comma-separated: tokens x heads per program x warps")


def benchmark(args, results: harness.Results) -> None:
    for config in args.configs.split(","):
        tokens, heads, warps = (int(n) for n in config.split("x"))
        for paired in (True, False):
            results.save(compile_kernel(args.arch, tokens, heads, warps, paired))


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke=None, layout="list")


if __name__ == "__main__":
    main()
