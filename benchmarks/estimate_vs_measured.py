"""``omnispec explain --estimate`` against measured runs: peak device memory and time per step.
No peer: the measured run on the same configs (random bf16 weights) is the reference for the estimate.

``python -m benchmarks.estimate_vs_measured [--workloads flux,wan] [--offload none,layerwise] [--json FILE]``
(needs CUDA; ``--smoke`` runs the tiny checkpoints on the CPU to check the script)

Each workload is written as a checkpoint of config files only (real FLUX.1-dev / Wan2.1-T2V-14B configs: the
transformer, CLIP-L, T5-XXL / UMT5-XXL, the VAE; tokenizers trained here), which is all the estimate reads (no
safetensors: it counts parameters from the configs on the meta device). The measured run builds the same
modules from those configs with random bf16 weights, hands them to ``omnispec.build(components=...)`` and runs the
bundled spec's request: the peak is ``torch.cuda.max_memory_allocated`` over a whole request (encode, denoise,
decode) after a warm-up request; the step time is the difference between a long and a short request over the step
difference, so encoding and decoding cancel. The issue's targets: peak within 15%, step time within 25%.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import harness

# The bundled spec, the request sizes, and the steps of the short and long requests for each workload.
WORKLOADS = {
    "flux": {"spec": "flux1-dev", "request": {}, "steps": (2, 6)},
    "wan": {"spec": "wan2.1-t2v-1.3b", "request": {}, "steps": (2, 4)},
}
SMOKE_OVERRIDES = {
    "flux": ["model.dtype=float32", "recipe.defaults.height=64", "recipe.defaults.width=64",
             "recipe.defaults.max_sequence_length=16"],
    "wan": ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32", "recipe.defaults.frames=5",
            "recipe.defaults.max_sequence_length=16"],
}


def _t5_config(umt5: bool):
    import transformers

    cls = transformers.UMT5Config if umt5 else transformers.T5Config
    return cls(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384 if umt5 else 32128,
               feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1)


def flux_checkpoint(root: Path) -> None:
    """FLUX.1-dev's configs (no weights)."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from omnispec.testing import clip_tokenizer, t5_tokenizer

    size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)) if harness.SMOKE else {}
    transformer = dict(guidance_embeds=True, **size)
    _write(root / "transformer", FluxTransformer2DModel, transformer)
    clip = transformers.CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                       num_hidden_layers=12, vocab_size=49408, projection_dim=768,
                                       max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    t5 = _t5_config(umt5=False)
    if harness.SMOKE:
        clip = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                                           num_hidden_layers=2, vocab_size=400, projection_dim=32,
                                           max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
        t5 = transformers.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=256,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)
    clip.architectures = ["CLIPTextModel"]
    clip.save_pretrained(root / "text_encoder")
    t5.architectures = ["T5EncoderModel"]
    t5.save_pretrained(root / "text_encoder_2")
    clip_tokenizer().save_pretrained(root / "tokenizer")
    t5_tokenizer().save_pretrained(root / "tokenizer_2")
    vae = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
               layers_per_block=2, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
               use_post_quant_conv=False)
    if harness.SMOKE:
        vae.update(block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                   up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1, norm_num_groups=4)
    _write(root / "vae", AutoencoderKL, vae)
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096).save_config(root / "scheduler")


def wan_checkpoint(root: Path) -> None:
    """Wan2.1-T2V-14B's configs (no weights)."""
    import transformers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    from omnispec.testing import t5_tokenizer

    transformer = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                       out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                       qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    umt5 = _t5_config(umt5=True)
    vae: dict = {}
    if harness.SMOKE:
        transformer.update(num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=2,
                           rope_max_seq_len=32)
        umt5 = transformers.UMT5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=256,
                                       relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                                       eos_token_id=1)
        vae = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                   temperal_downsample=[False, True, True])
    _write(root / "transformer", WanTransformer3DModel, transformer)
    umt5.architectures = ["UMT5EncoderModel"]
    umt5.save_pretrained(root / "text_encoder")
    t5_tokenizer().save_pretrained(root / "tokenizer")
    _write(root / "vae", AutoencoderKLWan, vae)
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                            num_train_timesteps=1000).save_config(root / "scheduler")


def _write(folder: Path, cls: type, config: dict) -> None:
    """A diffusers model's config.json, as ``save_pretrained`` writes it, without building the model."""
    with torch.device("meta"):
        model = cls.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)


CHECKPOINTS = {"flux": flux_checkpoint, "wan": wan_checkpoint}


def random_components(spec, root: Path, on_device: bool) -> dict:
    """The spec's components from the configs at ``root`` with freshly initialised (random) weights in their dtypes,
    on the device, or on the host for offloaded runs."""
    from omnispec.estimate import config_module
    from omnispec.runtime.components import DTYPES, component_class, load_components
    from omnispec.spec.model import WEIGHTLESS_ROLES

    light = {n: c for n, c in spec.model.components.items() if c.role in WEIGHTLESS_ROLES}
    mods = load_components(spec, str(root), only=light)
    device = harness.DEVICE if on_device else "cpu"
    for name, component in spec.model.components.items():
        if name not in light:
            mods[name] = config_module(component_class(component), root / component.subfolder,
                                       DTYPES[component.dtype or spec.model.dtype], component.config, device)
    return mods


def measure(pipe, request: dict, steps: tuple[int, int], repeats: int) -> dict:
    pipe("a photo of a cat", seed=0, steps=steps[0], **request)  # warm-up
    harness.sync()
    if harness.DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pipe("a photo of a cat", seed=0, steps=steps[0], **request)
    harness.sync()
    peak = torch.cuda.max_memory_allocated() if harness.DEVICE == "cuda" else None
    samples = []
    for _ in range(repeats):
        times = {}
        for n in steps:
            harness.sync()
            start = time.perf_counter()
            pipe("a photo of a cat", seed=0, steps=n, **request)
            harness.sync()
            times[n] = time.perf_counter() - start
        samples.append((times[steps[1]] - times[steps[0]]) / (steps[1] - steps[0]))
    return {"peak_bytes": peak, "step_s": statistics.median(samples), "step_samples": samples}


def run(workload: str, offload: str, repeats: int) -> dict:
    import omnispec
    from omnispec.estimate import estimate

    w = WORKLOADS[workload]
    overrides = [f"policies.offload={{strategy: {offload}}}", "runtime.progress=false",
                 *(SMOKE_OVERRIDES[workload] if harness.SMOKE else [])]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        CHECKPOINTS[workload](root)
        spec = omnispec.load_spec(w["spec"], [*overrides, "model.check_checkpoint=false"])
        start = time.perf_counter()
        est = estimate(spec, source=str(root), **w["request"])  # the kind of this machine's GPU
        estimate_s = time.perf_counter() - start
        mods = random_components(spec, root, on_device=offload == "none")
        pipe = omnispec.build(spec, components=mods, device=harness.DEVICE)
        measured = measure(pipe, w["request"], w["steps"], repeats)
        pipe = mods = None
        harness.free_device_memory()
    row = {"workload": workload, "offload": offload, "device": harness.DEVICE,
           "estimate": {"peak_bytes": est.peak_bytes, "peak_stage": est.peak_stage, "step_s": est.step_seconds,
                        "forward_flops": est.forward_flops, "timed_for": est.timed_for,
                        "transfer_s": est.transfer_seconds, "seconds_to_estimate": estimate_s},
           "measured": measured}
    if measured["peak_bytes"] and est.peak_bytes:
        row["peak_error"] = est.peak_bytes / measured["peak_bytes"] - 1
    if est.step_seconds:
        row["step_error"] = est.step_seconds / measured["step_s"] - 1
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="flux,wan")
    parser.add_argument("--offload", default="none,layerwise")
    parser.add_argument("--repeats", type=int, default=3)


def benchmark(args, results: harness.Results) -> None:
    for workload in args.workloads.split(","):
        for offload in args.offload.split(","):
            results.save(run(workload, offload, args.repeats))
    for r in results.rows:
        e, m = r["estimate"], r["measured"]
        peak = (f"peak {e['peak_bytes'] / 2**30:.2f} GiB est vs {m['peak_bytes'] / 2**30:.2f} GiB "
                f"({100 * r['peak_error']:+.0f}%)") if m["peak_bytes"] else "peak: not measured on a CPU"
        step = (f"step {1e3 * e['step_s']:.1f} ms est vs {1e3 * m['step_s']:.1f} ms ({100 * r['step_error']:+.0f}%)"
                if e["step_s"] else "step: not estimated")
        print(f"{r['workload']:<5} offload {r['offload']:<10} {peak}; {step}")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, layout="list", needs_cuda=True,
                          smoke="tiny configs on the CPU (checks the script, not numbers)")


if __name__ == "__main__":
    main()
