"""LTX-2 on one GPU: omnispec against diffusers on the same in-memory modules (real LTX-2 19B transformer config,
random bf16 weights, 512x768, 121 frames at 24 fps).

``python -m benchmarks.gpu_ltx2 [--parts step,keyframes,two_stage,memory,fp8] [--repeats 3] [--request-repeats 2]
[--json FILE] [--smoke]``

- ``step``: per-step time with CFG + STG + modality guidance on both streams (ltx2-t2v's plan) against
  ``LTX2Pipeline``, as the difference of a 4-step and a 2-step run over 2 steps (a 1-step LTX-2 schedule
  stretched to its terminal sigma is undefined in diffusers); MFU from FLOPs counted on one step; latent cosine
  of the two 2-step runs.
- ``keyframes``: the same for ltx2-keyframes (the ``ltx2_condition`` family: images at the first and the last
  frame) against ``LTX2ConditionPipeline`` with the same two conditions.
- ``two_stage``: a whole ltx2-two-stage request (half-size draft with full guidance, latent upsample, 3 refine
  steps, decode of video and audio) against diffusers' chain of LTX2Pipeline -> LTX2LatentUpsamplePipeline ->
  LTX2Pipeline, as diffusers' docs chain them. Neither side loads the distilled LoRA (no Hub here).
- ``memory``: peak device memory of a 2-step run, everything resident and with layerwise offload.
- ``fp8``: fp8_dynamic (per row) + regional compile against bf16 eager: step time and the cosine of one step's
  latents.

The text encoder is a one-layer Gemma 3 of the real width (the 12B encoder only runs once per request and its
cost cancels in per-step times); the connectors have the real width and depth with a projection sized to that
encoder. The VAEs, vocoder and latent upsampler have their default (real) configs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu_interpreter import flops_per_step, free_device_memory, matmul_ceiling, per_step, per_step_sides

ROOT = Path(__file__).resolve().parents[1]
SMOKE = False
DEVICE = "cuda"
SIZE = dict(height=512, width=768, frames=121, fps=24)
PROMPT = "a jazz band playing in a small club at night, warm light, close-up of the saxophone player"


def components() -> dict:
    """Real-size LTX-2 modules with random weights (bf16), or the tiny test ones in smoke mode."""
    if SMOKE:
        from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

        from omnispec.testing.ltx2_fixtures import ltx2_components

        mods = ltx2_components(version="2.0")
        mods["latent_upsampler"] = LTX2LatentUpsamplerModel(in_channels=4, mid_channels=32, num_blocks_per_stage=1)
        return mods
    import transformers
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from omnispec.testing import gemma_tokenizer

    tokenizer = gemma_tokenizer()
    v = len(tokenizer)
    with torch.device(DEVICE):
        text_encoder = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config={"vocab_size": v, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 1,
                         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256},
            vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4, boi_token_index=v - 3, eoi_token_index=v - 2, image_token_index=v - 1))
        # LTX-2 19B (diffusers' conversion config "2.0"): the class defaults, with the real split RoPE.
        transformer = LTX2VideoTransformer3DModel(rope_type="split")
        connectors = LTX2TextConnectors(
            caption_channels=3840, text_proj_in_factor=2, video_connector_num_attention_heads=30,
            video_connector_attention_head_dim=128, video_connector_num_layers=2,
            video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
            audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
            audio_connector_num_learnable_registers=128, connector_rope_base_seq_len=4096, rope_type="split")
        # The VAEs and vocoder of LTX-2 (diffusers' conversion config "2.0"; the classes' defaults differ).
        vae = AutoencoderKLLTX2Video(
            latent_channels=128, block_out_channels=(256, 512, 1024, 2048), decoder_block_out_channels=(256, 512, 1024),
            layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
            spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False, False, False, False),
            downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(True, True, True),
            upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
            encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
            decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, attn_resolutions=None,
            in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=64,
            double_z=True)
        vocoder = LTX2Vocoder(
            in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
            upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
            leaky_relu_negative_slope=0.1, output_sampling_rate=24000)
        mods = dict(transformer=transformer, text_encoder=text_encoder, connectors=connectors, vae=vae,
                    audio_vae=audio_vae, vocoder=vocoder)
    mods["latent_upsampler"] = LTX2LatentUpsamplerModel()  # its blur kernel is built by a matmul CUDA lacks for int64
    mods = {k: m.to(DEVICE, torch.bfloat16).eval() for k, m in mods.items()}
    mods["tokenizer"] = tokenizer
    mods["scheduler"] = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1)
    return mods


def _one_stage_spec_overrides() -> list[str]:
    over = ["runtime.progress=false", "model.check_checkpoint=false"]
    if SMOKE:
        over += ["model.dtype=float32", "recipe.constraints.frames_multiple_of=4",
                 "recipe.constraints.size_multiple_of=16", "recipe.phases.0.guidance.terms.1.layers=[1]"]
    return over


def _guidance_kwargs() -> dict:
    return dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0,
                audio_modality_scale=3.0, guidance_rescale=0.7, audio_guidance_rescale=0.7,
                spatio_temporal_guidance_blocks=[1] if SMOKE else [28])


def _diffusers_size() -> dict:
    return dict(height=SIZE["height"], width=SIZE["width"], num_frames=SIZE["frames"], frame_rate=float(SIZE["fps"]))


def _build(spec: str, mods: dict, extra: list[str] = ()):
    import omnispec

    keep = {k: v for k, v in mods.items() if k != "latent_upsampler" or "two-stage" in spec}
    return omnispec.build(ROOT / "specs" / spec, components=keep, device=DEVICE,
                          overrides=[*_one_stage_spec_overrides(), *extra])


def step_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = ()) -> dict:
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    return _step_rows("step", _build("ltx2-t2v.yaml", mods, overrides), LTX2Pipeline, mods, {}, {}, repeats, ceiling)


def keyframes_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = ()) -> dict:
    """The ltx2_condition family: ltx2-keyframes with an image at the first and at the last frame, against
    ``LTX2ConditionPipeline`` with the same two conditions. The first replaces latent frame 0's tokens, the last is
    appended as one latent frame of keyframe tokens (6,144 video tokens become 6,912 at 512x768x121)."""
    from diffusers.pipelines.ltx2 import LTX2ConditionPipeline, LTX2VideoCondition
    from PIL import Image

    from benchmarks.gpu_interpreter import conditioning_inputs

    first, _ = conditioning_inputs(SIZE["height"], SIZE["width"])
    last = first.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    ours = {"conditions": [{"image": first, "frame": 0}, {"image": last, "frame": -1}]}
    theirs = {"conditions": [LTX2VideoCondition(frames=first, index=0), LTX2VideoCondition(frames=last, index=-1)]}
    return _step_rows("keyframes", _build("ltx2-keyframes.yaml", mods, overrides), LTX2ConditionPipeline, mods, ours,
                      theirs, repeats, ceiling)


def _step_rows(part: str, pipe, pipeline_class, mods: dict, ours_kwargs: dict, theirs_kwargs: dict, repeats: int,
               ceiling: float) -> dict:
    """Per-step time of omnispec's pipeline against ``pipeline_class`` on the same modules (one round of each per
    repeat, interleaved), MFU, and the cosine of the two 2-step runs' video latents (unpacked, keyframes dropped)."""
    ref = pipeline_class(**{k: v for k, v in mods.items() if k != "latent_upsampler"})
    ref.set_progress_bar_config(disable=True)

    def ours(n):
        return pipe.generate(pipe.request(PROMPT, 0, steps=n, **SIZE, **ours_kwargs), decode=False)

    def theirs(n):
        return ref(prompt=PROMPT, num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="latent", return_dict=False, **_diffusers_size(), **_guidance_kwargs(), **theirs_kwargs)

    lo, hi = (2, 3) if SMOKE else (2, 4)  # --smoke: fewer steps (one would give diffusers NaN sigmas), no warm-up
    with torch.no_grad():
        if not SMOKE:
            ours(2), theirs(2)  # warm-up
        flops = flops_per_step(ours, steps=2) / 2
        timed = per_step_sides({"diffusers": theirs, "omnispec": ours}, lo, hi, repeats)
        rows = {label: {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples],
                        "mfu": flops / med / ceiling} for label, (med, samples) in timed.items()}
        a = ours(2).latents
        video, audio = theirs(2)
    geometry = pipe.family.geometry(pipe.request(PROMPT, 0, **SIZE, **ours_kwargs), 1.0)
    unpacked = pipe.family.unpack("video", a["video"], geometry)
    cos = torch.nn.functional.cosine_similarity(unpacked.float().flatten(), video.float().flatten(), dim=0).item()
    return {"part": part, "tflop_per_step": flops / 1e12, **rows,
            "ratio": rows["omnispec"]["ms_per_step"] / rows["diffusers"]["ms_per_step"], "video_latent_cosine": cos}


def two_stage_part(mods: dict, repeats: int) -> dict:
    if not SMOKE:
        return _two_stage_part(mods, repeats)
    saved = dict(SIZE)
    SIZE.update(height=64, width=64)  # --smoke: the half-size draft must still be a multiple of 32 for diffusers
    try:
        return _two_stage_part(mods, repeats)
    finally:
        SIZE.update(saved)


def _two_stage_part(mods: dict, repeats: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2Pipeline

    # --smoke: a two-step draft on both sides (the refine stage keeps its three sigmas), one request, no warm-up
    draft_steps = 2 if SMOKE else 30
    pipe = _build("ltx2-two-stage.yaml", mods, ["model.adapters={}", "recipe.phases.1.adapter=null"]
                  + (["recipe.phases.0.guidance.terms.1.layers=[1]", f"recipe.defaults.steps={draft_steps}"]
                     if SMOKE else []))
    stage_1 = LTX2Pipeline(**{k: v for k, v in mods.items() if k != "latent_upsampler"})
    stage_2 = LTX2Pipeline(**{**{k: v for k, v in mods.items() if k != "latent_upsampler"},
                              "scheduler": FlowMatchEulerDiscreteScheduler.from_config(
                                  mods["scheduler"].config, use_dynamic_shifting=False, shift_terminal=None)})
    upsample = LTX2LatentUpsamplePipeline(vae=mods["vae"], latent_upsampler=mods["latent_upsampler"])
    for p in (stage_1, stage_2, upsample):
        p.set_progress_bar_config(disable=True)
    sigmas = [0.909375, 0.725, 0.421875]

    def ours():
        out = pipe.generate(pipe.request(PROMPT, 0, **SIZE))
        return out.array, out.audio

    def theirs():
        g = [torch.Generator("cpu").manual_seed(0)]
        half = {**_diffusers_size(), "height": SIZE["height"] // 2, "width": SIZE["width"] // 2}
        video, audio = stage_1(prompt=PROMPT, num_inference_steps=draft_steps, generator=g, output_type="latent",
                               return_dict=False, **half, **_guidance_kwargs())
        video = upsample(latents=video, latents_normalized=False, output_type="latent", return_dict=False)[0]
        return stage_2(latents=video, audio_latents=audio, prompt=PROMPT, num_inference_steps=3, sigmas=sigmas,
                       noise_scale=sigmas[0], guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                       audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
                       audio_guidance_rescale=0.0, generator=g, output_type="np", return_dict=False,
                       **{k: v for k, v in _diffusers_size().items() if k in ("num_frames", "frame_rate")})

    times: dict[str, list[float]] = {"omnispec": [], "diffusers": []}
    with torch.no_grad():
        if not SMOKE:
            ours(), theirs()  # warm-up
        for _ in range(1 if SMOKE else repeats):
            for label, run in (("diffusers", theirs), ("omnispec", ours)):
                _sync()
                start = time.perf_counter()
                run()
                _sync()
                times[label].append(time.perf_counter() - start)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"part": "two_stage", "request_s": med, "samples_s": times, "ratio": med["omnispec"] / med["diffusers"]}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gib(run) -> float:
    if DEVICE != "cuda":
        run()
        return 0.0
    free_device_memory()
    torch.cuda.reset_peak_memory_stats()
    run()
    return torch.cuda.max_memory_allocated() / 2**30


def memory_part(mods: dict, repeats: int) -> dict:
    out = {"part": "memory"}
    for label, extra in (("resident", []), ("layerwise", ["policies.offload={strategy: layerwise}"])):
        pipe = _build("ltx2-t2v.yaml", mods, extra)

        def one(p=pipe):
            with torch.no_grad():
                p.generate(p.request(PROMPT, 0, steps=2, **SIZE), decode=False)

        if not SMOKE:  # --smoke: the measured call runs the same code
            one()  # warm-up (offload hooks, first-call allocations)
        start = time.perf_counter()
        out[f"{label}_peak_gib"] = _peak_gib(one)
        out[f"{label}_one_step_s"] = time.perf_counter() - start
        pipe = None
        free_device_memory()
    return out


def fp8_part(mods: dict, repeats: int, ceiling: float) -> dict:
    pipe = _build("ltx2-t2v.yaml", mods)

    def run_with(p):
        def run(n):
            return p.generate(p.request(PROMPT, 0, steps=n, **SIZE), decode=False)
        return run

    with torch.no_grad():
        run_with(pipe)(2)
        bf16_ms = per_step(run_with(pipe), 2, 4, repeats)[0] * 1e3
        reference = run_with(pipe)(2).latents
    pipe = None
    free_device_memory()
    quant = "policies.quantization={transformer: {method: fp8_dynamic, granularity: row}}"
    fast = _build("ltx2-t2v.yaml", mods, [quant, "policies.compile={mode: regional}"])
    with torch.no_grad():
        start = time.perf_counter()
        run_with(fast)(2)  # compiles
        compile_s = time.perf_counter() - start
        fp8_ms = per_step(run_with(fast), 2, 4, repeats)[0] * 1e3
        latents = run_with(fast)(2).latents
    cos = {s: torch.nn.functional.cosine_similarity(latents[s].float().flatten(), reference[s].float().flatten(),
                                                    dim=0).item() for s in latents}
    return {"part": "fp8", "bf16_eager_ms_per_step": bf16_ms, "fp8_regional_ms_per_step": fp8_ms,
            "speedup": bf16_ms / fp8_ms, "first_call_s": compile_s, "latent_cosine": cos}


PARTS = {"step": step_part, "keyframes": keyframes_part, "two_stage": two_stage_part, "memory": memory_part,
         "fp8": fp8_part}


def enable_smoke() -> None:
    """Tiny LTX-2 modules on the CPU at 32x32x5 (checks the script only)."""
    global SMOKE, DEVICE
    import benchmarks.gpu_interpreter as gi

    SMOKE, DEVICE = True, "cpu"
    gi.DEVICE = "cpu"
    SIZE.update(height=32, width=32, frames=5, fps=25)


def interpreter_row(workload: str, part: str, repeats: int, ceiling: float, overrides: list[str],
                    smoke: bool) -> dict:
    """A ``gpu_interpreter`` row (its keys) from the ``step`` or ``keyframes`` part, so that one command times
    every family; LTX-2's modules, size and guidance stay here."""
    if smoke:
        enable_smoke()
    row = PARTS[part](components(), repeats, ceiling, overrides)
    free_device_memory()
    return {"workload": workload, "overrides": list(overrides), "tflop_per_step": row["tflop_per_step"],
            "diffusers": row["diffusers"], "omnispec": row["omnispec"], "ratio": row["ratio"],
            "latent_cosine": row["video_latent_cosine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="step,two_stage,memory")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of per-step timings")
    parser.add_argument("--request-repeats", type=int, default=2, help="repeats of whole two-stage requests")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script only)")
    args = parser.parse_args()
    if args.smoke:
        enable_smoke()
    ceiling = 1e12 if SMOKE else matmul_ceiling()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    print(f"{device}  torch {torch.__version__}  bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    mods = components()
    for name in args.parts.split(","):
        part = PARTS[name]
        if name in ("step", "keyframes", "fp8"):
            row = part(mods, args.repeats, ceiling)
        else:
            row = part(mods, args.request_repeats if name == "two_stage" else args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"ceiling_tflops": ceiling / 1e12, "size": SIZE, "rows": rows}, indent=1))
        free_device_memory()


if __name__ == "__main__":
    main()
