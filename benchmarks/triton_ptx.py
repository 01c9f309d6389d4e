"""What omnispec's Triton kernels (``qk_norm_rope``, ``int8_fp8``) compile to for a GPU, on a machine without one.
No peer: facts of one kernel's code (registers, spills, load and store widths) per launch shape, to read, not time.

``python -m benchmarks.triton_ptx [--kernel qk_norm_rope|int8_fp8] [--arch 90] [--configs ...] [--json FILE]``
(needs triton, whose wheel carries the ptxas that gives registers and spills). ``--configs``: for ``qk_norm_rope``
tokens x heads x warps (default 16x4x4,16x2x4); for ``int8_fp8`` the attention kernel's launches
(``kernels.int8_fp8.Launch``: query rows x key rows x warps x stages, ``+tma``), each at head size 128 and, with
``:64``, another (default: the launches by head size, ``LAUNCHES``). For ``int8_fp8`` the rows also name the
tensor-core instructions (``wgmma`` shapes and types) and count the int32-to-float conversions, TMA copies and
exponentials.

A memory-bound kernel moves its bytes at the memory's speed only when each thread loads and stores 16 bytes an
instruction. Triton decides that from what it can prove about a pointer's contiguity and alignment, and releases
differ: the kernel's first form, which chose the head stride (the text stream's or the image stream's) per token,
compiled to 16-byte loads under triton 3.6 and 3.7.1 (torch 2.11's and 2.13's) and to 2-byte loads under 3.9
(BENCHMARKS.md, 2026-12-05). This compiles the kernel as a launch at FLUX's shapes specializes it (every pointer and
integer argument divisible by 16; bf16 tensors, float32 angles) and reports, per launch shape and for q and k in one
launch or one launch each: registers, spilled bytes, and the global loads and stores by width.
"""

from __future__ import annotations

import re

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


def compile_int8_fp8(arch: int, launch, dim: int) -> dict:
    """The int8_fp8 attention kernel compiled for ``sm_<arch>`` at ``launch`` (``kernels.int8_fp8.Launch``) and head
    size ``dim``, as a launch specializes it (q and k int8, v e4m3, pointers or tensor descriptors, every pointer and
    integer divisible by 16): ``compiled_facts`` and the PTX's tensor-core instructions, int32-to-float conversions,
    TMA copies and exponentials."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from omnispec.kernels.int8_fp8 import QUANT_BLOCK
    from omnispec.kernels.int8_fp8_triton import attention_kernel as kernel

    constants = {"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "D": dim, "QUANT_BLOCK": QUANT_BLOCK,
                 "TMA": launch.tma}
    tiles = {"q": (launch.block_m, dim, "i8"), "k": (launch.block_n, dim, "i8"), "v": (dim, launch.block_n, "fp8e4nv")}
    operands = {name: f"tensordesc<{kind}[{rows}, {cols}]>" if launch.tma else f"*{kind}"
                for name, (rows, cols, kind) in tiles.items()} | {"out": "*bf16"}
    signature = {name: "constexpr" if name in constants else operands.get(name) or (
        "*fp32" if name.endswith("scales") else "fp32" if name == "qk_scale" else "i32") for name in kernel.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name].startswith(("*", "i32"))}
    options = {"num_warps": launch.warps, "num_stages": launch.stages}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=divisible)
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    return {"config": f"{launch} d{dim}", "arch": f"sm_{arch}", "triton": triton.__version__,
            **compiled_facts(kernel, signature, constants, divisible, arch, options),
            "tensor_core": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))),
            "int32_to_float": ptx.count("cvt.rn.f32.s32"), "tma_copies": ptx.count("cp.async.bulk.tensor"),
            "exponentials": ptx.count("ex2.approx"), "p_rounding": sorted(set(re.findall(r"cvt\.rn\S*e4m3\S*", ptx)))}


def add_arguments(parser) -> None:
    parser.add_argument("--kernel", choices=("qk_norm_rope", "int8_fp8"), default="qk_norm_rope")
    parser.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (90: H100/H200)")
    parser.add_argument("--configs", help="launch shapes, comma-separated (the docstring says per kernel)")


def benchmark(args, results: harness.Results) -> None:
    if args.kernel == "int8_fp8":
        from omnispec.kernels.int8_fp8 import LAUNCHES, Launch

        configs = args.configs.split(",") if args.configs else [f"{launch}:{dim}" for dim, launch in LAUNCHES.items()]
        for config in configs:
            text, _, dim = config.partition(":")
            try:
                launch = Launch.parse(text)
            except ValueError as exc:
                raise harness.UsageError(f"--configs: {exc}") from None
            results.save(compile_int8_fp8(args.arch, launch, int(dim or 128)))
        return
    for config in (args.configs or "16x4x4,16x2x4").split(","):
        tokens, heads, warps = (int(n) for n in config.split("x"))
        for paired in (True, False):
            results.save(compile_kernel(args.arch, tokens, heads, warps, paired))


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke=None, layout="list")


if __name__ == "__main__":
    main()
