"""LTX-2 on one GPU at real size: step time, keyframes, a two-stage request, peak memory and fp8 step time.
Peer: diffusers' LTX2Pipeline / LTX2ConditionPipeline (and its two-stage chain) on the same in-memory modules, eager,
in the same call; the fp8 rows against omnispec's own bf16 eager. The real LTX-2 19B transformer config, random bf16
weights, 512x768, 121 frames at 24 fps.

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

The modules, size, prompt and guidance plan, and the ``step`` and ``keyframes`` comparisons, are
``benchmarks/workloads.py``'s, shared with ``gpu_interpreter``'s ``ltx2`` workloads: a one-layer Gemma 3 text
encoder of the real width (the 12B encoder only runs once per request and its cost cancels in per-step times), the
connectors at their real width and depth, the VAEs, vocoder and latent upsampler at their default (real) configs.
"""

from __future__ import annotations

import time

import torch

from . import harness
from .workloads import (
    LTX2_PROMPT,
    LTX2_SIZE,
    ltx2_build,
    ltx2_components,
    ltx2_diffusers_size,
    ltx2_guidance_kwargs,
    ltx2_keyframes_part,
    ltx2_step_part,
)


def two_stage_part(mods: dict, repeats: int) -> dict:
    if not harness.SMOKE:
        return _two_stage_part(mods, repeats)
    saved = dict(LTX2_SIZE)
    LTX2_SIZE.update(height=64, width=64)  # --smoke: the half-size draft must still be a multiple of 32 for diffusers
    try:
        return _two_stage_part(mods, repeats)
    finally:
        LTX2_SIZE.update(saved)


def _two_stage_part(mods: dict, repeats: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2Pipeline

    # --smoke: a two-step draft on both sides (the refine stage keeps its three sigmas), one request, no warm-up
    draft_steps = 2 if harness.SMOKE else 30
    pipe = ltx2_build("ltx2-two-stage.yaml", mods, ["model.adapters={}", "recipe.phases.1.adapter=null"]
                      + (["recipe.phases.0.guidance.terms.1.layers=[1]", f"recipe.defaults.steps={draft_steps}"]
                         if harness.SMOKE else []))
    stage_1 = LTX2Pipeline(**{k: v for k, v in mods.items() if k != "latent_upsampler"})
    stage_2 = LTX2Pipeline(**{**{k: v for k, v in mods.items() if k != "latent_upsampler"},
                              "scheduler": FlowMatchEulerDiscreteScheduler.from_config(
                                  mods["scheduler"].config, use_dynamic_shifting=False, shift_terminal=None)})
    upsample = LTX2LatentUpsamplePipeline(vae=mods["vae"], latent_upsampler=mods["latent_upsampler"])
    for p in (stage_1, stage_2, upsample):
        p.set_progress_bar_config(disable=True)
    sigmas = [0.909375, 0.725, 0.421875]

    def ours():
        out = pipe.generate(pipe.request(LTX2_PROMPT, 0, **LTX2_SIZE))
        return out.array, out.audio

    def theirs():
        g = [torch.Generator("cpu").manual_seed(0)]
        half = {**ltx2_diffusers_size(), "height": LTX2_SIZE["height"] // 2, "width": LTX2_SIZE["width"] // 2}
        video, audio = stage_1(prompt=LTX2_PROMPT, num_inference_steps=draft_steps, generator=g, output_type="latent",
                               return_dict=False, **half, **ltx2_guidance_kwargs())
        video = upsample(latents=video, latents_normalized=False, output_type="latent", return_dict=False)[0]
        return stage_2(latents=video, audio_latents=audio, prompt=LTX2_PROMPT, num_inference_steps=3, sigmas=sigmas,
                       noise_scale=sigmas[0], guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                       audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
                       audio_guidance_rescale=0.0, generator=g, output_type="np", return_dict=False,
                       **{k: v for k, v in ltx2_diffusers_size().items() if k in ("num_frames", "frame_rate")})

    times: dict[str, list[float]] = {"omnispec": [], "diffusers": []}
    with torch.no_grad():
        if not harness.SMOKE:
            ours(), theirs()  # warm-up
        for _ in range(1 if harness.SMOKE else repeats):
            for label, run in (("diffusers", theirs), ("omnispec", ours)):
                harness.sync()
                start = time.perf_counter()
                run()
                harness.sync()
                times[label].append(time.perf_counter() - start)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"part": "two_stage", "request_s": med, "samples_s": times, "ratio": med["omnispec"] / med["diffusers"]}


def _peak_gib(run) -> float:
    if harness.DEVICE != "cuda":
        run()
        return 0.0
    harness.free_device_memory()
    torch.cuda.reset_peak_memory_stats()
    run()
    return torch.cuda.max_memory_allocated() / 2**30


def memory_part(mods: dict, repeats: int) -> dict:
    out = {"part": "memory"}
    for label, extra in (("resident", []), ("layerwise", ["policies.offload={strategy: layerwise}"])):
        pipe = ltx2_build("ltx2-t2v.yaml", mods, extra)

        def one(p=pipe):
            with torch.no_grad():
                p.generate(p.request(LTX2_PROMPT, 0, steps=2, **LTX2_SIZE), decode=False)

        if not harness.SMOKE:  # --smoke: the measured call runs the same code
            one()  # warm-up (offload hooks, first-call allocations)
        start = time.perf_counter()
        out[f"{label}_peak_gib"] = _peak_gib(one)
        out[f"{label}_one_step_s"] = time.perf_counter() - start
        pipe = None
        harness.free_device_memory()
    return out


def fp8_part(mods: dict, repeats: int, ceiling: float) -> dict:
    pipe = ltx2_build("ltx2-t2v.yaml", mods)

    def run_with(p):
        def run(n):
            return p.generate(p.request(LTX2_PROMPT, 0, steps=n, **LTX2_SIZE), decode=False)
        return run

    with torch.no_grad():
        run_with(pipe)(2)
        bf16_ms = harness.per_step(run_with(pipe), 2, 4, repeats)[0] * 1e3
        reference = run_with(pipe)(2).latents
    pipe = None
    harness.free_device_memory()
    quant = "policies.quantization={transformer: {method: fp8_dynamic, granularity: row}}"
    fast = ltx2_build("ltx2-t2v.yaml", mods, [quant, "policies.compile={mode: regional}"])
    with torch.no_grad():
        start = time.perf_counter()
        run_with(fast)(2)  # compiles
        compile_s = time.perf_counter() - start
        fp8_ms = harness.per_step(run_with(fast), 2, 4, repeats)[0] * 1e3
        latents = run_with(fast)(2).latents
    cos = {s: torch.nn.functional.cosine_similarity(latents[s].float().flatten(), reference[s].float().flatten(),
                                                    dim=0).item() for s in latents}
    return {"part": "fp8", "bf16_eager_ms_per_step": bf16_ms, "fp8_regional_ms_per_step": fp8_ms,
            "speedup": bf16_ms / fp8_ms, "first_call_s": compile_s, "latent_cosine": cos}


PARTS = {"step": ltx2_step_part, "keyframes": ltx2_keyframes_part, "two_stage": two_stage_part,
         "memory": memory_part, "fp8": fp8_part}


def add_arguments(parser) -> None:
    parser.add_argument("--parts", default="step,two_stage,memory")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of per-step timings")
    parser.add_argument("--request-repeats", type=int, default=2, help="repeats of whole two-stage requests")


def benchmark(args, results: harness.Results) -> None:
    ceiling = harness.matmul_ceiling()
    results.header |= {"ceiling_tflops": ceiling / 1e12, "size": LTX2_SIZE}
    print(f"{harness.device_name()}  torch {torch.__version__}  bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s",
          flush=True)
    mods = ltx2_components()
    for name in args.parts.split(","):
        part = PARTS[name]
        if name in ("step", "keyframes", "fp8"):
            results.save(part(mods, args.repeats, ceiling))
        else:
            results.save(part(mods, args.request_repeats if name == "two_stage" else args.repeats))
        harness.free_device_memory()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark)


if __name__ == "__main__":
    main()
