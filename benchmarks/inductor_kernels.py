"""The Triton kernels inductor writes for FLUX's compiled blocks under omnispec's policies, compiled for a GPU here.
No peer: facts of the code (rows read once or looped, registers, spills, load and store widths), to read, not time;
``--set`` gives another policy's kernels to set beside them.

``python -m benchmarks.inductor_kernels [--set policies.compile.persistent_rows=1024 ...] [--norms 1536,5120]
[--arch 90] [--json FILE]`` (needs triton; ``--smoke``: FLUX's blocks at two heads of 16 dims; ``--norms``: a
modulated float32 RMSNorm and LayerNorm alone at each width, the other families' norms, in place of FLUX's blocks)

Builds a FLUX.1-dev-width transformer (24 heads of 128, 3,072 channels) of one double and one single block through
``omnispec.build`` with regional compile, the fused q/k norm + RoPE, the fused GELU and the modulation table (and
``--set``'s overrides: ``persistent_rows=1024`` for inductor's own norm rule in place of the rows read once), and
runs one 256² step on the CPU with inductor's Triton code generation (``cpu_backend="triton"``): each kernel's
source is kept, not launched. Each kernel is then compiled for
``sm_<arch>`` with the launch inductor would choose on such a GPU (its first configuration: the only one for a
reduction under ``fixed_reductions``; pointwise kernels are timed among a few at their first launch) and with every
pointer 16-byte aligned, as inductor finds a GPU's inputs (on the CPU it marks none aligned). Per kernel: whether a
reduction reads its rows once (``per``) or loops over them (``red``), the launch, registers and spilled bytes
(ptxas), and the global loads and stores by width, 16 bytes (``v4.b32``) being what moves bytes at the memory's
speed. The row counts are 256²'s; the code is the same at 1024² but for its sizes.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from . import harness
from .kernel_timing import compiled_facts
from .workloads import SMOKE_TEXT, flux_components

POLICIES = ["runtime.progress=false", "policies.attention.default=sdpa", "policies.compile.mode=regional",
            "policies.attention.fused_qk_norm_rope=true", "policies.mlp.fused_gelu=true",
            "policies.mlp.precomputed_modulation=true", "model.dtype=bfloat16"]
# An H200's properties, as inductor's launch heuristics read them.
HOPPER = dict(type="cuda", index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
              max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)


@contextlib.contextmanager
def kept_kernel_sources() -> Iterator[list[tuple[str, str]]]:
    """Inductor set to write Triton code for the CPU, each kernel's (name, source) kept and a launch that does
    nothing returned in its place; inductor's caches off, so every kernel is written."""
    import torch._inductor.config as config
    import torch.utils._triton as torch_triton
    from torch._inductor.async_compile import AsyncCompile

    kept: list[tuple[str, str]] = []

    class NoLaunch:
        def run(self, *args, **kwargs) -> None:
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    def keep(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> NoLaunch:
        kept.append((kernel_name, source_code))
        return NoLaunch()

    saved = AsyncCompile.triton, torch_triton.triton_hash_with_backend
    AsyncCompile.triton = keep
    torch_triton.triton_hash_with_backend = lambda: "inductor_kernels"  # asks a GPU driver otherwise
    try:
        with config.patch(cpu_backend="triton", compile_threads=1, force_disable_caches=True):
            yield kept
    finally:
        AsyncCompile.triton, torch_triton.triton_hash_with_backend = saved


def flux_kernels(overrides: list[str], smoke: bool) -> list[tuple[str, str]]:
    """The Triton kernels of one step of the FLUX block pair built with ``overrides``."""
    from diffusers import FluxTransformer2DModel

    import omnispec

    harness.enable_smoke()  # the text encoders and the VAE tiny, on the CPU
    components = flux_components()
    width = dict(num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 4, 8)) if smoke else {}
    components["transformer"] = FluxTransformer2DModel(
        guidance_embeds=True, num_layers=1, num_single_layers=1, joint_attention_dim=SMOKE_TEXT[1],
        pooled_projection_dim=SMOKE_TEXT[0], **width).to(torch.bfloat16)
    pipe = omnispec.build(harness.ROOT / "specs" / "flux1-dev.yaml", components=components, device="cpu",
                          overrides=[*POLICIES, *overrides])
    with kept_kernel_sources() as kept:
        pipe("a cat", height=64 if smoke else 256, width=64 if smoke else 256, steps=1, seed=0)
    return list(kept)


def _rms_norm_modulated(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor):
    """An RMSNorm computed in float32 over the whole width (Wan's q and k norms run across the heads), then
    modulated."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    return h * (1 + scale) + shift


def _layer_norm_modulated(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor):
    """A LayerNorm computed in float32 (Wan's ``FP32LayerNorm``; SD3.5's and Qwen-Image's blocks norm their width
    too), then modulated."""
    h = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], weight.float(), eps=1e-6).to(x.dtype)
    return h * (1 + scale) + shift


def norm_kernels(widths: list[int], overrides: list[str]) -> list[tuple[str, str, str]]:
    """The Triton kernels (name, source, shape) of the other families' norm shapes at each row width, compiled
    alone with the compile policy ``overrides`` give (FLUX's own norms come from ``flux_kernels``)."""
    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec import load_spec

    policy = load_spec(harness.ROOT / "specs" / "flux1-dev.yaml", ["policies.compile.mode=regional", *overrides])
    options = {**_torch_compile_options(policy.policies.compile), "fx_graph_cache": False}
    kept_all = []
    bf16 = {"dtype": torch.bfloat16}
    for width in widths:
        args = (torch.randn(1, 64, width, **bf16), torch.randn(width, **bf16), torch.randn(1, 1, width, **bf16),
                torch.randn(1, 1, width, **bf16))
        for fn in (_rms_norm_modulated, _layer_norm_modulated):
            torch._dynamo.reset()
            with kept_kernel_sources() as kept:
                torch.compile(fn, fullgraph=True, dynamic=False, options=options)(*args)
            kept_all += [(name, source, f"{fn.__name__.strip('_')} {width}") for name, source in kept]
    return kept_all


def _kernel_and_launches(name: str, source: str, folder: str) -> tuple:
    """The kernel's Triton function, the launch configurations inductor's decorator gives it on an H200, and its
    Triton metadata: the source run with the decorator's ``cached_autotune`` keeping what it is given."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.hints import DeviceProperties

    captured: dict = {}

    def cached_autotune(size_hints, configs, triton_meta, **kwargs):
        captured.update(configs=configs, triton_meta=triton_meta)
        return lambda fn: fn

    hopper = DeviceProperties(**HOPPER)
    code = source.replace("triton_helpers.set_driver_to_cpu()", "").replace("DeviceProperties(", "_on_hopper(")
    path = Path(folder) / f"{name}.py"  # triton reads a kernel's source from its file
    path.write_text(code)
    namespace = {"__file__": str(path), "__name__": name, "_on_hopper": lambda *args, **kwargs: hopper}
    saved, triton_heuristics.cached_autotune = triton_heuristics.cached_autotune, cached_autotune
    try:
        exec(compile(code, str(path), "exec"), namespace)
    finally:
        triton_heuristics.cached_autotune = saved
    return namespace[name], captured["configs"], captured["triton_meta"]


def compiled_for_gpu(name: str, source: str, arch: int) -> dict:
    """``name``'s kernel compiled for ``sm_<arch>`` with inductor's first launch configuration."""
    with tempfile.TemporaryDirectory() as folder:
        kernel, launches, meta = _kernel_and_launches(name, source, folder)
        launch = launches[0]
        signature = dict(meta["signature"])
        attrs = dict(meta["configs"][0]) if meta.get("configs") else {}
        attrs |= {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
        facts = compiled_facts(kernel, signature, {k: v for k, v in launch.kwargs.items() if k in signature}, attrs,
                               arch, {"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                      "enable_fp_fusion": meta.get("enable_fp_fusion", True)})
    return {"kernel": name, "rows_read": {"per": "once", "red": "looped"}.get(name.split("_")[1], ""),
            "launch": {**launch.kwargs, "num_warps": launch.num_warps}, "launches_tried": len(launches), **facts}


def add_arguments(parser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a spec override on top of the regional compile and fused policies (repeatable)")
    parser.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (90: H100/H200)")
    parser.add_argument("--norms", metavar="WIDTH[,WIDTH...]",
                        help="in place of FLUX's blocks: a float32 RMSNorm and LayerNorm, each modulated, over rows "
                             "of these widths (the other families' norms: SD3.5 1,536, Qwen-Image 3,072, Wan 14B "
                             "5,120)")


def benchmark(args, results: harness.Results) -> None:
    results.header["set"] = args.set
    if args.norms:
        kernels = norm_kernels([int(w) for w in args.norms.split(",")], args.set)
    else:
        kernels = [(name, source, "flux block pair") for name, source in flux_kernels(args.set, args.smoke)]
    for name, source, shape in kernels:
        results.save({"shape": shape, **compiled_for_gpu(name, source, args.arch)})


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="two heads of 16 dims (checks the script only)")


if __name__ == "__main__":
    main()
