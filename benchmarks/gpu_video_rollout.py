"""RL rollout throughput (videos/s) on Wan2.2 TI2V-5B, exact, eager and under regional compile, with the replay ratio.
Peer: a Flow-GRPO-style sampling loop around diffusers' ``WanPipeline`` (the pattern of Flow-GRPO's and DanceGRPO's
Wan trainers), in the same call, eager and over the same compiled blocks.

``python -m benchmarks.gpu_video_rollout [--prompts 4 --group 4 --steps 10 --height 480 --width 832 --frames 33
--window 3 --baseline-batch 4 --repeats 2] [--no-eager] [--no-compile] [--json FILE]``  (needs CUDA; ``--smoke``:
tiny models on the CPU, to check the script only.)

Random bf16 weights at Wan2.2 TI2V-5B's sizes (30 blocks of 24 heads of 128, 48 latent channels, the Wan2.2 VAE;
``workloads.wan_ti2v_components``), a rank-32 LoRA on the attention projections, the spec's CFG 5 against the empty
prompt, text-to-video. Both sides step the checkpoint's UniPC sigmas (flow shift 5) as Flow-GRPO's Wan pipeline
does: the SDE (noise level 0.7) on a window of ``--window`` steps from step 0, first-order Euler steps elsewhere
(omnispec: ``sampler.multistep: euler``), a timestep per token (``expand_timesteps``). The loop encodes every
sample's prompt and runs CFG as one concatenated forward per step, ``--baseline-batch`` samples at a time, as those
trainers do. Videos/s include prompt encoding and decoding. Under ``compile: regional`` omnispec compiles the
shared transformer's blocks in place, so the loop runs the same compiled blocks (diffusers' own
``compile_repeated_blocks`` would compile the same regions). Replay: omnispec's ``log_prob`` of part of a compiled
rollout (another micro-batch), without and with gradients: max |ratio - 1| (0.0 is exact).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from . import harness
from .flow_grpo import NOISE_LEVEL, check_sigmas, prompts, timed, walk
from .workloads import WAN_LORA_TARGETS, wan_ti2v_components, with_lora

CFG_SCALE, MAX_TOKENS = 5.0, 512
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
                              gen)
        x = states[-1]
        vae = pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device)
        video = vae.decode((x * std + mean).to(vae.dtype), return_dict=False)[0]
        return {"videos": pipe.video_processor.postprocess_video(video, output_type="pt"),
                "log_probs": torch.stack(lps, 1) if lps else None}


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--window", type=int, default=3,
                        help="SDE steps from step 0, the rest Euler steps (0: every step but the last)")
    parser.add_argument("--baseline-batch", type=int, default=4, help="the loop's samples per call")
    parser.add_argument("--replay-batch", type=int, default=4, help="rollout samples the replay rows replay")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="the eager rows")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the rows under compile: regional (both sides over the same compiled blocks)")


def benchmark(args, results: harness.Results) -> None:
    import omnispec

    if args.smoke:  # tiny models: 2 x 2 samples of 64x64x5, 4 steps, a window of 2, one repeat
        args.height = args.width = 64
        args.frames, args.prompts, args.group, args.steps, args.window = 5, 2, 2, 4, 2
        args.repeats, args.baseline_batch, args.replay_batch = 1, 2, 2
    mods = with_lora(wan_ti2v_components(), WAN_LORA_TARGETS)
    window = range(args.window or args.steps - 1)  # 0: every step but the last, as gpu_rollout
    sampler = {"kind": "sde", "noise_level": NOISE_LEVEL, "multistep": "euler",
               "window": {"kind": "fixed", "start": 0, "length": len(window)}}
    request = {"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps}
    n = args.prompts * args.group
    results.header |= {"device": harness.device_name(), "setup": {k: v for k, v in vars(args).items() if k != "json"}
                       | {"videos": n, "window_steps": list(window)}}

    def build(*overrides: str):
        return omnispec.build(harness.ROOT / "specs" / "wan2.2-ti2v-5b.yaml", components=mods, device=harness.DEVICE,
                              overrides=["runtime.progress=false", *overrides])

    loop = WanGRPOLoop(mods, args.height, args.width, args.frames, args.steps, window)

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
        part = rollout.select(range(min(args.replay_batch, n)))
        for grad, steps in ((False, None), (True, [0])):
            replayed = pipe.log_prob(part, steps=steps, grad=grad).log_probs.detach().cpu()
            stored = part.log_probs if steps is None else part.log_probs[:, steps]
            results.save({"config": f"replay ratio{label}{', with gradients' if grad else ''}",
                          "max_abs_ratio_minus_1": (replayed - stored).exp().sub(1).abs().max().item(),
                          "replayed_samples": len(part.log_probs)})

    pipe = build()
    check_sigmas(pipe, loop.pipe.scheduler, args.steps, request)
    if args.eager:
        rows("", pipe)
    if args.compile:
        smoke_backend = ["policies.compile.backend=aot_eager"] if args.smoke else []  # inductor's CPU codegen: minutes
        rows(", regional compile", build("policies.compile.mode=regional", *smoke_backend))
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| config | s per batch | videos/s | the loop's time / this one's (same compile) |")
    loops = {row["compile"]: row for row in rows if row["config"].startswith(LOOP)}
    for row in rows:
        if "videos_per_s" in row:
            print(f"| {row['config']} | {row['seconds']:.2f} | {row['videos_per_s']:.2f} | "
                  f"{loops[row['compile']]['seconds'] / row['seconds']:.2f}x |")
        elif "max_abs_ratio_minus_1" in row:
            print(f"| {row['config']} | max abs ratio - 1: {row['max_abs_ratio_minus_1']:.2e} | | |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="tiny models on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
