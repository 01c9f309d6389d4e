"""Does a compiled denoiser block compute the same bits with gradients on as off?
No peer: the same block's outputs without gradients are the reference for those with them, part by part.

``python -m benchmarks.gpu_replay_bits [--bases bf16,fp8_dynamic:row] [--batch 16] [--json FILE]``  (needs CUDA;
``--smoke``: tiny block on the CPU)

A rollout runs the denoiser's inference graphs; a trainer's replay (``log_prob(..., grad=True)``) runs the forward
that AOTAutograd partitions out of a joint forward-backward graph, which also stores what the backward reads. The
ratio a trainer reads is exactly 1 only if both forwards give the same bits. This builds one SD3.5-medium joint
block at its real width (random weights; a dual-attention block with a rank-32 LoRA on the attention projections,
its B matrices nonzero), on a bf16 or torchao-quantized base as omnispec's quantization policy makes it, compiles
it with omnispec's compile options (``compile: regional``), and compares, bitwise, its outputs without and with
gradients: the whole block, then each part compiled alone with its input requiring gradients as it does inside the
block, down to single linears. The first part that differs names the kernel to look at (``TORCH_LOGS=output_code``
prints both graphs' code).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import harness
from .workloads import SD3_LORA_TARGETS


def sd35_block(base: str, smoke: bool, fused_gelu: bool = False) -> torch.nn.Module:
    """One dual-attention SD3.5-medium joint block (1536 wide, 24 heads of 64), bf16, on ``base``, with a LoRA
    whose B is nonzero (peft starts B at zero, which would hide any difference in the LoRA's path); with
    ``fused_gelu``, its feed-forwards' first projections as ``policies.mlp.fused_gelu`` makes them."""
    from diffusers.models.attention import JointTransformerBlock
    from peft import LoraConfig, inject_adapter_in_model

    heads, head_dim = (2, 16) if smoke else (24, 64)
    torch.manual_seed(0)
    with torch.device(harness.DEVICE):
        block = JointTransformerBlock(heads * head_dim, heads, head_dim, qk_norm="rms_norm", use_dual_attention=True)
    block = block.to(torch.bfloat16).eval().requires_grad_(False)
    if base != "bf16":
        from torchao.quantization import quantize_

        from omnispec.policies.quantization import keep_input_gradients, torchao_config

        method, _, granularity = base.partition(":")
        quantize_(block, torchao_config(method, granularity or None))
        keep_input_gradients({"block": block})
    block = inject_adapter_in_model(LoraConfig(r=32, lora_alpha=64, target_modules=SD3_LORA_TARGETS), block)
    for name, p in block.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if fused_gelu:
        from omnispec.policies.mlp import fuse_gelus

        fuse_gelus(block)
    return block


def block_inputs(block: torch.nn.Module, batch: int, smoke: bool) -> dict[str, torch.Tensor]:
    """SD3.5 at 512²: 32 x 32 image tokens and 77 + 256 text tokens (the CLIPs' and T5's)."""
    dim = block.norm1.linear.in_features
    image, text = (16, 8) if smoke else (1024, 333)
    g = torch.Generator(harness.DEVICE).manual_seed(1)
    make = lambda *shape: torch.randn(*shape, generator=g, device=harness.DEVICE).to(torch.bfloat16)
    return {"hidden_states": make(batch, image, dim), "encoder_hidden_states": make(batch, text, dim),
            "temb": make(batch, dim)}


def parts(block: torch.nn.Module, x: dict[str, torch.Tensor]) -> list[tuple[str, torch.nn.Module, Callable]]:
    """(name, module, call(module, inputs)) from the whole block down to single linears, each given inputs shaped
    as inside the block."""
    h, e, t = x["hidden_states"], x["encoder_hidden_states"], x["temb"]
    return [
        ("block", block, lambda m, r: m(r(h), r(e), r(t))),
        ("norm1 (AdaLayerNormZeroX)", block.norm1, lambda m, r: m(r(h), emb=r(t))),
        ("norm1_context (AdaLayerNormZero)", block.norm1_context, lambda m, r: m(r(e), emb=r(t))),
        ("attn (joint, LoRA)", block.attn, lambda m, r: m(hidden_states=r(h), encoder_hidden_states=r(e))),
        ("attn2 (image only, no LoRA)", block.attn2, lambda m, r: m(hidden_states=r(h))),
        ("ff", block.ff, lambda m, r: m(r(h))),
        ("norm2", block.norm2, lambda m, r: m(r(h))),
        ("attn.to_q (LoRA linear)", block.attn.to_q, lambda m, r: m(r(h))),
        ("attn.to_out.0 (LoRA linear)", block.attn.to_out[0], lambda m, r: m(r(h))),
        (f"ff.net.0 ({type(block.ff.net[0]).__name__}: linear + GELU)", block.ff.net[0], lambda m, r: m(r(h))),
        ("ff.net.2 (linear, 4x wide input)", block.ff.net[2],
         lambda m, r: m(r(torch.cat([h, h, h, h], dim=-1)))),
    ]


def flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out if o is not None for t in flat(o)]


def compare(call: Callable, module: torch.nn.Module) -> dict:
    """The part's outputs without gradients and with them (inputs requiring gradients), bitwise."""
    with torch.no_grad():
        plain = [t.float() for t in flat(call(module, lambda t: t))]
    with torch.enable_grad():
        traced = [t.detach().float() for t in flat(call(module, lambda t: t.detach().requires_grad_(True)))]
    diffs = [(a - b).abs() for a, b in zip(plain, traced, strict=True)]
    return {"max_abs_diff": max(d.max().item() for d in diffs),
            "differing_fraction": sum((d > 0).sum().item() for d in diffs) / sum(d.numel() for d in diffs),
            "max_abs_value": max(a.abs().max().item() for a in plain)}


def probe(base: str, batch: int, smoke: bool, only: set[str] | None, save, fused_gelu: bool = False) -> None:
    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec.policies import CompilePolicy

    options = _torch_compile_options(CompilePolicy(mode="regional"))
    block = sd35_block(base, smoke, fused_gelu)
    x = block_inputs(block, batch, smoke)
    for name, module, call in parts(block, x):
        if only and not any(name.startswith(o) for o in only):
            continue
        row = {"base": base, "batch": batch, "fused_gelu": fused_gelu, "part": name, "eager": compare(call, module)}
        torch.compiler.reset()
        compiled = torch.compile(module, fullgraph=True, dynamic=False,
                                 **({"backend": "eager"} if smoke else {"options": options}))
        print(f"[{base}] {name}: compiling", flush=True)
        row["compiled"] = compare(call, compiled)
        save(row)


def add_arguments(parser) -> None:
    parser.add_argument("--bases", default="bf16,fp8_dynamic:row",
                        help="comma-separated: bf16, or a quantization method[:granularity] as the policy takes it")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--parts", default="", help="comma-separated prefixes of the parts to probe (default: all)")
    parser.add_argument("--fused-gelu", action="store_true",
                        help="the block's feed-forwards as policies.mlp.fused_gelu makes them (cuBLASLt's epilogue)")


def benchmark(args, results: harness.Results) -> None:
    if args.smoke:
        args.batch, args.bases = 2, "bf16"
    results.header["setup"] = {k: v for k, v in vars(args).items() if k != "json"}
    only = {p for p in args.parts.split(",") if p} or None
    for base in args.bases.split(","):
        probe(base, args.batch, args.smoke, only, results.save, args.fused_gelu)
        harness.free_device_memory()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="a tiny block on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
