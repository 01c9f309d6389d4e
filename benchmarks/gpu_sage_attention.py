"""How fast and how close to bf16 are Sage-style int8 attentions (``sage``, ``int8_fp8``) at Wan's shapes?
Peer: torch's flash attention kernel (SDPA), the bf16 exact baseline, and FlashAttention-4 (``flash4``, where
installed), forward and forward + backward.

``python -m benchmarks.gpu_sage_attention [--iters 10] [--shapes wan14b_480p_self,wan14b_480p_cross]
[--int8-fp8-launches 128x64x4x3,128x128x8x3+tma,...] [--json FILE]`` (needs CUDA; ``sage`` rows need ``pip install
sageattention``; ``--smoke``: a tiny shape on the CPU, where ``sage`` and ``int8_fp8`` are omnispec's plain-torch
references)

Each row is one attention call at a shape of Wan2.1 14B T2V 480x832x81 with CFG (batch 2: 21 latent frames of 30x52
tokens, 40 heads of 128; self-attention over the video's 32,760 tokens, cross-attention to 512 text tokens), bf16,
laid out as the model hands q, k and v to SDPA ([batch, tokens, heads, dim] seen as [batch, heads, tokens, dim]):

- ``flash``: ``F.scaled_dot_product_attention`` on torch's flash kernel, forward, and forward + backward;
- ``sage``: ``omnispec.kernels.sage.sage_attention`` (``sageattn`` forward; the backward exact attention's at the same
  inputs, recomputed on torch's flash kernel, so forward + backward costs the int8 forward plus a flash forward and
  backward);
- ``flash4``: FlashAttention-4 through omnispec's operators (``kernels/flash4.py``), its backward FA4's own;
- ``int8_fp8``: ``omnispec.kernels.int8_fp8.int8_fp8_attention`` (omnispec's Triton kernel: int8 Q·K, fp8 P·V; its
  backward exact attention's as ``sage``'s), one row per ``--int8-fp8-launches`` launch (query rows x key rows x
  warps x stages, ``+tma``: tiles loaded by tensor descriptors), with ``cosine_kernel_vs_reference`` against
  ``int8_fp8_reference`` on the first ``--check-rows`` query rows;
- ``sage reference``: the plain-torch reference on the first ``--check-rows`` query rows (whole quantization blocks,
  the whole K), untimed: the check of the kernel (``cosine_kernel_vs_reference``) and, with P·V in float8
  (``pv="fp8"``), what an fp8 P·V would cost in accuracy.

Milliseconds per call (CUDA events, median of five rounds of ``--iters`` calls after a warm-up that compiles the
Triton kernels), the speed-up over ``flash`` (forward and forward + backward), TFLOP/s of the forward (4 · q tokens ·
k tokens · heads · dim · batch per call), and the cosine of the output against the bf16 flash output. The inputs are
random, whose attention is nearly uniform; a step's prediction cosine on a model is ``benchmarks.gpu_interpreter
--workloads wan --also policies.attention.default=sage``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import harness

# batch, heads, query tokens, key tokens, head size
SHAPES = {
    "wan14b_480p_self": (2, 40, 32760, 32760, 128),
    "wan14b_480p_cross": (2, 40, 32760, 512, 128),
}


def add_arguments(parser) -> None:
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--int8-fp8-launches", default="",
                        help="launches of the int8_fp8 kernel to time besides its default, comma-separated: query rows x "
                             "key rows x warps x stages, then +tma for descriptor loads, e.g. 128x64x4x3,128x128x8x3+tma")
    parser.add_argument("--check-rows", type=int, default=1024,
                        help="query rows the plain-torch reference checks the kernel on (a multiple of 128)")


def _milliseconds(fn, iters: int) -> float:
    fn()  # warm-up: Triton compiles its kernels for this shape
    rounds = []
    for _ in range(5):
        harness.sync()
        if harness.DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                fn()
            rounds.append((time.perf_counter() - begin) * 1e3 / iters)
    return statistics.median(rounds)


def _flash(q, k, v):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v)


def _with_backward(fn, q, k, v, grad_out):
    def run():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
    return run


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _inputs(batch, heads, q_tokens, k_tokens, head_dim, device, dtype):
    generator = torch.Generator(device).manual_seed(0)
    return [torch.randn(batch, tokens, heads, head_dim, device=device, dtype=dtype, generator=generator)
            .transpose(1, 2).requires_grad_(True) for tokens in (q_tokens, k_tokens, k_tokens)]


def _flash4(q, k, v):
    from omnispec.kernels.flash4 import flash4_sdpa

    return flash4_sdpa(q, k, v, None)


def _int8_fp8_launch(launch: str | None):
    """``int8_fp8_attention`` with the kernel's launch for this head size set to ``launch`` (``int8_fp8.Launch``'s
    text; None: the default)."""
    from omnispec.kernels import int8_fp8

    chosen = int8_fp8.Launch.parse(launch) if launch else None

    def run(q, k, v):
        if chosen is None:
            return int8_fp8.int8_fp8_attention(q, k, v)
        default = int8_fp8.LAUNCHES.get(q.shape[-1])
        int8_fp8.LAUNCHES[q.shape[-1]] = chosen
        try:
            return int8_fp8.int8_fp8_attention(q, k, v)
        finally:
            int8_fp8.LAUNCHES[q.shape[-1]] = default if default is not None else int8_fp8.Launch()
    return run


def _kernels(launches: str) -> list[tuple[str, object]]:
    """The timed configurations: flash, flash4 where importable, sage, int8_fp8 and its extra launches."""
    import importlib.util

    from omnispec.kernels.sage import sage_attention

    kernels = [("flash", _flash)]
    if harness.DEVICE == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        kernels.append(("flash4", _flash4))
    kernels += [("sage", sage_attention), ("int8_fp8", _int8_fp8_launch(None))]
    for launch in filter(None, launches.split(",")):
        kernels.append((f"int8_fp8 {launch}", _int8_fp8_launch(launch)))
    return kernels


def _shape_rows(shape: str, dims: tuple, iters: int, check_rows: int, launches: str,
                results: harness.Results) -> None:
    from omnispec.kernels.int8_fp8 import int8_fp8_reference
    from omnispec.kernels.sage import sage_reference

    batch, heads, q_tokens, k_tokens, head_dim = dims
    device = harness.DEVICE
    q, k, v = _inputs(*dims, device, torch.bfloat16 if device == "cuda" else torch.float32)
    flops = 4 * batch * heads * q_tokens * k_tokens * head_dim
    with torch.no_grad():
        bf16 = _flash(q, k, v)
    grad_out = torch.randn_like(bf16)
    timed = {}
    for name, fn in _kernels(launches):
        try:
            with torch.no_grad():
                out = fn(q, k, v)
                forward_ms = _milliseconds(lambda fn=fn: fn(q, k, v), iters)
            backward_ms = _milliseconds(_with_backward(fn, q, k, v, grad_out), iters)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is a row of its own
            results.save({"shape": shape, "config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        timed[name] = (forward_ms, backward_ms)
        row = {"shape": shape, "config": name, "forward_ms": forward_ms, "forward_backward_ms": backward_ms,
               "forward_tflops": flops / forward_ms / 1e9, "cosine_vs_bf16": _cosine(out, bf16)}
        if "flash" in timed:
            row |= {"forward_speedup": timed["flash"][0] / forward_ms,
                    "forward_backward_speedup": timed["flash"][1] / backward_ms}
        if name == "sage" or name.startswith("int8_fp8"):
            rows = min(check_rows, q_tokens)
            with torch.no_grad():
                reference = (sage_reference if name == "sage" else int8_fp8_reference)(q[:, :, :rows], k, v)
            row["cosine_kernel_vs_reference"] = _cosine(out[:, :, :rows], reference)
        results.save(row)
        del out
        harness.free_device_memory()
    rows = min(check_rows, q_tokens)
    with torch.no_grad():
        for pv in ("input", "fp8"):
            results.save({"shape": shape, "config": f"sage reference (pv {pv}, first {rows} query rows)",
                          "cosine_vs_bf16": _cosine(sage_reference(q[:, :, :rows], k, v, pv=pv), bf16[:, :, :rows])})
    harness.free_device_memory()


def benchmark(args, results: harness.Results) -> None:
    if args.check_rows % 128:
        raise harness.UsageError(f"--check-rows: a multiple of 128 (whole quantization blocks), got {args.check_rows}")
    from omnispec.kernels.int8_fp8 import Launch

    try:
        [Launch.parse(launch) for launch in filter(None, args.int8_fp8_launches.split(","))]
    except ValueError as exc:
        raise harness.UsageError(f"--int8-fp8-launches: {exc}") from None
    shapes = {"tiny": (1, 2, 300, 200, 32)} if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    results.header = {"device": harness.device_name(), "torch": torch.__version__}
    for shape, dims in shapes.items():
        _shape_rows(shape, dims, 1 if args.smoke else args.iters, 256 if args.smoke else args.check_rows,
                    "" if args.smoke else args.int8_fp8_launches, results)


if __name__ == "__main__":
    harness.run_benchmark(__doc__, add_arguments, benchmark, needs_cuda=True)
