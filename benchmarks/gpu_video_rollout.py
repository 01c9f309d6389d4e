"""RL rollout throughput (videos/s) on a video family, exact, eager and under regional compile, with the replay ratio.
Peer: a Flow-GRPO-style sampling loop around the family's diffusers pipeline (``WanPipeline``, ``LTX2Pipeline``; the
pattern of Flow-GRPO's and DanceGRPO's video trainers), in the same call, eager and over the same compiled blocks.
The family: Wan2.2 TI2V-5B (``--model wan_ti2v``) or LTX-2.3 with its audio (``--model ltx23``).

``python -m benchmarks.gpu_video_rollout [--model wan_ti2v|ltx23] [--prompts 4 --group 4 --steps 10 --height H
--width W --frames F --window 3 --baseline-batch 4 --repeats 2] [--no-eager] [--no-compile] [--profile]
[--json FILE]``  (needs CUDA; ``--smoke``: tiny models on the CPU, to check the script only.)

Random bf16 weights at the release's sizes, a rank-32 LoRA on the attention projections, CFG against the empty
prompt, text-to-video, 16 videos by default. Both sides step the same sigmas (checked before timing: equal, or
within float32 rounding where diffusers warps the schedule in float32; the largest difference is in the header): the
SDE (noise level 0.7) on a window of ``--window`` steps from step 0, first-order Euler steps elsewhere. The loop
encodes every sample's prompt and runs CFG as one concatenated forward per step, ``--baseline-batch`` samples at a
time, as those trainers do. Videos/s include prompt encoding and decoding. Under ``compile: regional`` omnispec
compiles the shared transformer's blocks in place, so the loop runs the same compiled blocks (diffusers' own
``compile_repeated_blocks`` would compile the same regions). omnispec decodes with ``policies.vae.slicing`` (one
sample at a time: 16 videos at once do not fit beside the model on an 80 GB card); the policy slices the VAE modules
themselves, which the loop shares, so the loop's batches decode one sample at a time too. The sides' outputs differ
in kind: omnispec's rollout hands back its videos as float32 arrays on the host, the loop keeps them on the device.
Replay: omnispec's ``log_prob`` of a rollout's samples (all of them by default, as a trainer replays its batch;
``--replay-batch`` fewer), without and with gradients (the device's memory choosing micro-batches, and for a 19B
model checkpointed blocks), valued as the rollout's own forwards ran (``exact``): max |ratio - 1| (0.0 is exact).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from . import harness
from .flow_grpo import NOISE_LEVEL, check_sigmas, module_seconds, profiled_rollout, prompts, timed, walk
from .workloads import WAN_LORA_TARGETS, ltx2_spec_overrides, ltx23_components, wan_ti2v_components, with_lora

CFG_SCALE, MAX_TOKENS = 5.0, 512
LTX_CFG, LTX_MAX_TOKENS = {"video": 3.0, "audio": 7.0}, 1024
LOOP = "flow-grpo loop (diffusers)"


class WanGRPOLoop:
    """Flow-GRPO's sampling pattern around ``WanPipeline(expand_timesteps=True)``: per batch of samples, encode the
    prompts, then per step one CFG forward of the concatenated batch and, on the window's steps, an SDE step with its
    log-prob (an Euler step elsewhere); then decode as the pipeline decodes."""

    def __init__(self, mods: dict, height: int, width: int, frames: int, steps: int, window: range) -> None:
        import diffusers

        self.pipe = diffusers.WanPipeline(**mods, expand_timesteps=True)
        self.pipe.set_progress_bar_config(disable=True)
        self.height, self.width, self.frames, self.steps, self.window = height, width, frames, steps, window
        self.neg = self._encode([""])

    def schedule(self) -> dict:
        """``set_timesteps``' keywords beyond the step count: none (UniPC's flow sigmas of the checkpoint)."""
        return {}

    def _encode(self, texts: list[str]) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=MAX_TOKENS,
                                            device=harness.DEVICE)
        return embeds

    def _forward(self, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)  # expand_timesteps: t for every token
        out = self.pipe.transformer(hidden_states=torch.cat([x, x]).to(torch.bfloat16),
                                    timestep=t.to(x.device, torch.float32).expand(2 * n, tokens),
                                    encoder_hidden_states=torch.cat([self.neg.expand(n, -1, -1), embeds]),
                                    return_dict=False)[0]
        uncond, cond = out.float().chunk(2)
        return uncond + CFG_SCALE * (cond - uncond)

    def sample(self, texts: list[str], seed: int) -> dict:
        pipe = self.pipe
        embeds = self._encode(texts)
        gen = torch.Generator(harness.DEVICE).manual_seed(seed)
        x = pipe.prepare_latents(len(texts), pipe.vae.config.z_dim, self.height, self.width, self.frames,
                                 torch.float32, harness.DEVICE, gen)
        states, lps, _ = walk(lambda x, t: self._forward(x, t, embeds), x, pipe.scheduler, self.steps, self.window,
                              gen, **self.schedule())
        x = states[-1]
        vae = pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device)
        video = vae.decode((x * std + mean).to(vae.dtype), return_dict=False)[0]
        return {"videos": pipe.video_processor.postprocess_video(video, output_type="pt"),
                "log_probs": torch.stack(lps, 1) if lps else None}


class LTX2GRPOLoop:
    """The same pattern around ``LTX2Pipeline``, on both streams: per batch of samples, encode the prompts and run
    the connectors on the [empty prompt, prompts] pair as the pipeline does; then per step one CFG forward of the
    concatenated batch, the video and the audio each guided by its own scale, and on the window's steps an SDE step of
    each stream with the log-probs summed (an Euler step elsewhere); then decode the video and the audio (audio VAE
    and vocoder) as the pipeline decodes."""

    def __init__(self, mods: dict, height: int, width: int, frames: int, steps: int, window: range,
                 fps: float = 24.0) -> None:
        from diffusers.pipelines.ltx2 import LTX2Pipeline

        self.pipe = LTX2Pipeline(**mods)
        self.pipe.set_progress_bar_config(disable=True)
        self.height, self.width, self.frames, self.steps, self.window = height, width, frames, steps, window
        self.fps = fps
        self.neg = self._encode([""])

    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask, _, _ = self.pipe.encode_prompt(texts, do_classifier_free_guidance=False,
                                                     max_sequence_length=LTX_MAX_TOKENS, device=harness.DEVICE)
        return embeds, mask

    def grid(self) -> dict:
        """The latent grid of a video of this loop's size: video frames, height, width and audio frames."""
        pipe = self.pipe
        audio_per_s = pipe.audio_sampling_rate / pipe.audio_hop_length / pipe.audio_vae_temporal_compression_ratio
        return {"frames": (self.frames - 1) // pipe.vae_temporal_compression_ratio + 1,
                "height": self.height // pipe.vae_spatial_compression_ratio,
                "width": self.width // pipe.vae_spatial_compression_ratio,
                "audio_frames": round(self.frames / self.fps * audio_per_s)}

    def schedule(self) -> dict:
        """The checkpoint's sigmas for this size: ``set_timesteps``' keywords, as ``LTX2Pipeline`` computes them."""
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        g, config = self.grid(), self.pipe.scheduler.config
        tokens = g["frames"] * g["height"] * g["width"]
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        return {"sigmas": np.linspace(1.0, 1 / self.steps, self.steps), "mu": mu}

    def sample(self, texts: list[str], seed: int) -> dict:
        pipe, g, n = self.pipe, self.grid(), len(texts)
        embeds, mask = self._encode(texts)
        neg, neg_mask = self.neg
        video_ctx, audio_ctx, ctx_mask = pipe.connectors(
            torch.cat([neg.expand(n, -1, -1), embeds]), torch.cat([neg_mask.expand(n, -1), mask]),
            padding_side=getattr(pipe.tokenizer, "padding_side", "left"))
        gen = torch.Generator(harness.DEVICE).manual_seed(seed)
        audio_vae = pipe.audio_vae
        x = {"video": pipe.prepare_latents(n, pipe.transformer.config.in_channels, self.height, self.width,
                                           self.frames, 1.0, torch.float32, harness.DEVICE, gen),
             "audio": pipe.prepare_audio_latents(n, audio_vae.config.latent_channels, g["audio_frames"],
                                                 audio_vae.config.mel_bins, 1.0, torch.float32, harness.DEVICE, gen)}
        rope, audio_rope = pipe.transformer.rope, pipe.transformer.audio_rope
        video_coords = rope.prepare_video_coords(2 * n, g["frames"], g["height"], g["width"], harness.DEVICE,
                                                 fps=self.fps)
        audio_coords = audio_rope.prepare_audio_coords(2 * n, g["audio_frames"], harness.DEVICE)

        dtype = pipe.transformer.dtype

        def velocity(x: dict, t: torch.Tensor) -> dict:
            t = t.expand(2 * n)
            out = pipe.transformer(
                hidden_states=torch.cat([x["video"], x["video"]]).to(dtype),
                audio_hidden_states=torch.cat([x["audio"], x["audio"]]).to(dtype),
                encoder_hidden_states=video_ctx, audio_encoder_hidden_states=audio_ctx, timestep=t, sigma=t,
                encoder_attention_mask=ctx_mask, audio_encoder_attention_mask=ctx_mask, num_frames=g["frames"],
                height=g["height"], width=g["width"], fps=self.fps, audio_num_frames=g["audio_frames"],
                video_coords=video_coords, audio_coords=audio_coords, use_cross_timestep=True, return_dict=False)
            guided = {}
            for stream, pred in zip(("video", "audio"), out):
                uncond, cond = pred.float().chunk(2)
                guided[stream] = uncond + LTX_CFG[stream] * (cond - uncond)
            return guided

        states, lps, _ = walk(velocity, x, pipe.scheduler, self.steps, self.window, gen, **self.schedule())
        x = states[-1]
        vae = pipe.vae
        video = pipe._unpack_latents(x["video"], g["frames"], g["height"], g["width"],
                                     pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(video.to(vae.dtype), None, return_dict=False)[0]
        audio = pipe._denormalize_audio_latents(x["audio"], audio_vae.latents_mean, audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, g["audio_frames"], num_mel_bins=mel_bins)
        audio = pipe.vocoder(audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0])
        return {"videos": pipe.video_processor.postprocess_video(video, output_type="pt"), "audio": audio,
                "log_probs": torch.stack(lps, 1) if lps else None}


# What differs between the models: the spec, the modules (a LoRA added), the loop (whose ``schedule`` gives both
# its walk and check_sigmas the scheduler's keywords), the spec overrides (on top of runtime.progress=false; LTX-2.3:
# the loop's CFG alone), sampler fields and the default size.
MODELS = {
    "wan_ti2v": {"spec": "wan2.2-ti2v-5b.yaml", "components": wan_ti2v_components, "loop": WanGRPOLoop,
                 "overrides": lambda: [], "sampler": {"multistep": "euler"},
                 "size": {"height": 480, "width": 832, "frames": 33}},
    "ltx23": {"spec": "ltx2.3-t2v.yaml", "components": ltx23_components, "loop": LTX2GRPOLoop,
              "overrides": lambda: [*ltx2_spec_overrides(), "recipe.phases.0.guidance.rescale=0",
                                    "recipe.phases.0.guidance.terms=[{kind: cfg, scale: {video: %s, audio: %s}}]"
                                    % (LTX_CFG["video"], LTX_CFG["audio"])],
              "sampler": {}, "size": {"height": 512, "width": 768, "frames": 33}},
}
# ``--profile``: the modules' entry points each side's time is split at (a figure name: component, method)
PARTS = {"text_encode_s": ("text_encoder", "forward"), "connectors_s": ("connectors", "forward"),
         "denoiser_s": ("transformer", "forward"), "vae_decode_s": ("vae", "decode"),
         "audio_decode_s": ("audio_vae", "decode"), "vocoder_s": ("vocoder", "forward")}


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="wan_ti2v")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--height", type=int, help="default: the model's (wan_ti2v 480, ltx23 512)")
    parser.add_argument("--width", type=int, help="default: the model's (wan_ti2v 832, ltx23 768)")
    parser.add_argument("--frames", type=int, help="default: the model's (33)")
    parser.add_argument("--window", type=int, default=3,
                        help="SDE steps from step 0, the rest Euler steps (0: every step but the last)")
    parser.add_argument("--baseline-batch", type=int, default=4, help="the loop's samples per call")
    parser.add_argument("--replay-batch", type=int, help="rollout samples the replay rows replay (default: all)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="the eager rows")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the rows under compile: regional (both sides over the same compiled blocks)")
    parser.add_argument("--profile", action="store_true",
                        help="after each side's timing, one rollout of each split by module (encoders, denoiser, "
                             "decoders) and one under torch.profiler (device time by kernel kind, the largest kernels)")


def benchmark(args, results: harness.Results) -> None:
    # before the first allocation on the card: both sides' decodes and the replays allocate blocks of many sizes
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import omnispec

    model = MODELS[args.model]
    for key, value in model["size"].items():
        setattr(args, key, getattr(args, key) or value)
    if args.smoke:  # tiny models: 2 x 2 samples of 32x32x5, 4 steps, a window of 2, one repeat
        args.height = args.width = 32
        args.frames, args.prompts, args.group, args.steps, args.window = 5, 2, 2, 4, 2
        args.repeats, args.baseline_batch, args.replay_batch = 1, 2, 2
    mods = with_lora(model["components"](), WAN_LORA_TARGETS)  # both models name their projections as Wan does
    window = range(args.window or args.steps - 1)  # 0: every step but the last, as gpu_rollout
    sampler = {"kind": "sde", "noise_level": NOISE_LEVEL, **model["sampler"],
               "window": {"kind": "fixed", "start": 0, "length": len(window)}}
    request = {"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps}
    n = args.prompts * args.group
    results.header |= {"device": harness.device_name(), "setup": {k: v for k, v in vars(args).items() if k != "json"}
                       | {"videos": n, "window_steps": list(window)}}
    spec_overrides = ["runtime.progress=false", "policies.vae.slicing=true", *model["overrides"]()]

    def build(*overrides: str):
        return omnispec.build(harness.ROOT / "specs" / model["spec"], components=mods, device=harness.DEVICE,
                              overrides=[*spec_overrides, *overrides])

    loop = model["loop"](mods, args.height, args.width, args.frames, args.steps, window)

    def run_loop(tag: str):
        rows = [p for p in prompts(tag, args.prompts) for _ in range(args.group)]
        return [loop.sample(rows[i:i + args.baseline_batch], seed=i) for i in range(0, n, args.baseline_batch)]

    def run_ours(tag: str, pipe):
        return pipe.rollout(prompts(tag, args.prompts), group_size=args.group, seed=0, sampler=sampler, **request)

    def rows(label: str, pipe) -> None:
        sides = {f"{LOOP}{label}": run_loop, f"omnispec rollout{label}": lambda t: run_ours(t, pipe)}
        with torch.no_grad(), harness.CompileWatch() as watch:
            firsts = {side: timed(run, f"warm{label}")[0] for side, run in sides.items()}
            samples: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.repeats):  # interleaved, so drift hits both sides alike
                for i, (side, run) in enumerate(sides.items()):
                    samples[side].append(timed(run, f"{label}{r}-{i}")[0])
            rollout = run_ours(f"replay{label}", pipe)
        for side, times in samples.items():
            med = statistics.median(times)
            results.save({"config": side, "compile": label.removeprefix(", ") or "eager", "seconds": med,
                          "videos_per_s": n / med, "samples_s": times, "first_call_s": firsts[side]}
                         | ({"dynamo": watch.summary()} if label else {}))
        if args.profile:
            parts = {key: (mods[name], method) for key, (name, method) in PARTS.items() if name in mods}
            for side, run in sides.items():
                results.save({"config": f"{side}: where the time goes", "compile": label.removeprefix(", ") or "eager",
                              **module_seconds(parts, lambda: run(f"parts{label}")),
                              "device": profiled_rollout(lambda: run(f"profile{label}"))})
        part = rollout.select(range(min(args.replay_batch or n, n)))
        for grad, steps in ((False, None), (True, [0])):
            replayed = pipe.log_prob(part, steps=steps, grad=grad).log_probs.detach().cpu()
            stored = part.log_probs if steps is None else part.log_probs[:, steps]
            results.save({"config": f"replay ratio{label}{', with gradients' if grad else ''}",
                          "max_abs_ratio_minus_1": (replayed - stored).exp().sub(1).abs().max().item(),
                          "replayed_samples": len(part.log_probs)})

    pipe = build()
    results.header["sigmas_max_difference"] = check_sigmas(pipe, loop.pipe.scheduler, args.steps, request,
                                                           **loop.schedule())
    if args.eager:
        rows("", pipe)
    if args.compile:
        smoke_backend = ["policies.compile.backend=aot_eager"] if args.smoke else []  # inductor's CPU codegen: minutes
        rows(", regional compile", build("policies.compile.mode=regional", *smoke_backend))
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| config | s per batch | videos/s | the loop's time / this one's (same compile) |")
    loops = {row["compile"]: row for row in rows if row["config"].startswith(LOOP) and "videos_per_s" in row}
    for row in rows:
        if "videos_per_s" in row:
            print(f"| {row['config']} | {row['seconds']:.2f} | {row['videos_per_s']:.2f} | "
                  f"{loops[row['compile']]['seconds'] / row['seconds']:.2f}x |")
        elif "max_abs_ratio_minus_1" in row:
            print(f"| {row['config']} | max abs ratio - 1: {row['max_abs_ratio_minus_1']:.2e} | | |")
        elif "total_s" in row:
            split = ", ".join(f"{key[:-2]} {value:.2f}" for key, value in row.items()
                              if key.endswith("_s") and key != "total_s")
            print(f"| {row['config']} | {row['total_s']:.2f} | {split} | |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="tiny models on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
