"""RL rollout throughput (images/s) and replay time per step (log-prob with gradients) at SD3.5-medium size.
Peer: a Flow-GRPO-style sampling loop around the diffusers pipeline (its trainer's pattern), in the same call.

``python -m benchmarks.gpu_rollout [--prompts 16 --group 8 --steps 10 --size 512 --window 3 --window-start 0
--outside-every 2 --compress 0.4] [--json FILE]`` (``--smoke``: tiny models on the CPU, to check the script only.)
``--compress R`` below 1 adds a MixGRPO-Flash side: DPM-Solver++ after the window on R of its points, on a
flow_match schedule of shift 3 (the scheduler's sigmas), since a compressed walk needs the schedule's time warp.

Random bf16 weights at SD3.5-medium's sizes (MMDiT-X 24 blocks, CLIP-L, CLIP-G, T5-XXL encoders, the
16-channel VAE), a rank-32 LoRA on the attention projections as in Flow-GRPO's SD3 runs, CFG 4.5, prompts up
to 128 T5 tokens, outputs decoded. Both sides step the sigmas of the checkpoint's FlowMatchEulerDiscreteScheduler
(shift 3), as Flow-GRPO does: omnispec through the bundled spec's ``kind: scheduler`` schedule, the loop through
``scheduler.sigmas``. As in Flow-GRPO's fast trainer, the Flow-GRPO SDE (noise level 0.7) runs on a window of
``--window`` steps from ``--window-start`` (0: every step but the last) and the other steps are Euler steps.
The baseline is what Flow-GRPO's trainer does: it calls its copy of the pipeline's loop on ``--baseline-batch``
samples at a time (their ``sample.batch_size``, 8), encoding every sample's prompt, CFG as one concatenated
forward. "window-aware" rows give omnispec's sampler ``outside_window: {compute_every: K}``: outside the window
one deterministic step in K computes, the others reuse the last prediction; window steps stay exact. Each repeat
uses fresh prompts, so neither side reuses an encoding across repeats. Images/s include prompt encoding and
decoding. Replay: one stored step of ``--replay-batch`` samples, forward with gradients and backward of the
summed log-prob, per step.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from . import harness, inductor_passes
from .flow_grpo import NOISE_LEVEL, check_sigmas, module_seconds, profiled_rollout, prompts, sde_step, timed, walk
from .workloads import SD3_LORA_TARGETS, sd3_components

CFG_SCALE, MAX_TOKENS = 4.5, 128


class FlowGRPOLoop:
    """Flow-GRPO's sampling pattern around ``StableDiffusion3Pipeline``: per batch of samples, encode the
    prompts, then per step one CFG forward of the concatenated batch and, on the window's steps, an SDE step
    with its log-prob (an Euler step elsewhere, as their fast trainer's ``noise_level=0``)."""

    def __init__(self, mods: dict, size: int, steps: int, window: range) -> None:
        import diffusers

        self.pipe = diffusers.StableDiffusion3Pipeline(**mods)
        self.pipe.set_progress_bar_config(disable=True)
        self.size, self.steps, self.window = size, steps, window
        self.neg = self._encode([""])

    def _encode(self, texts: list[str]):
        pe, _, pooled, _ = self.pipe.encode_prompt(texts, texts, texts, device=harness.DEVICE,
                                                   do_classifier_free_guidance=False, max_sequence_length=MAX_TOKENS)
        return pe, pooled

    def _forward(self, x: torch.Tensor, t: torch.Tensor, pe, pooled) -> torch.Tensor:
        n = x.shape[0]
        embeds = torch.cat([self.neg[0].expand(n, -1, -1), pe])
        pooled_all = torch.cat([self.neg[1].expand(n, -1), pooled])
        out = self.pipe.transformer(hidden_states=torch.cat([x, x]).to(torch.bfloat16), timestep=t.expand(2 * n),
                                    encoder_hidden_states=embeds, pooled_projections=pooled_all, return_dict=False)[0]
        uncond, cond = out.float().chunk(2)
        return uncond + CFG_SCALE * (cond - uncond)

    def sample(self, texts: list[str], seed: int) -> dict:
        pipe = self.pipe
        pe, pooled = self._encode(texts)
        gen = torch.Generator(harness.DEVICE).manual_seed(seed)
        x = pipe.prepare_latents(len(texts), 16, self.size, self.size, torch.float32, harness.DEVICE, gen)
        states, lps, sigmas = walk(lambda x, t: self._forward(x, t, pe, pooled), x, pipe.scheduler, self.steps,
                                   self.window, gen)
        x = states[-1]
        vae = pipe.vae
        images = vae.decode((x / vae.config.scaling_factor + vae.config.shift_factor).to(vae.dtype), return_dict=False)[0]
        images = pipe.image_processor.postprocess(images, output_type="pt")
        return {"latents": torch.stack(states, 1), "log_probs": torch.stack(lps, 1), "images": images, "pe": pe,
                "pooled": pooled, "sigmas": sigmas, "timesteps": pipe.scheduler.timesteps}

    def replay_step(self, batch: dict, k: int) -> torch.Tensor:
        sig = batch["sigmas"]
        v = self._forward(batch["latents"][:, k], batch["timesteps"][k], batch["pe"], batch["pooled"])
        _, lp = sde_step(v, batch["latents"][:, k], sig[k], sig[k + 1], sig[1], prev=batch["latents"][:, k + 1])
        return lp


def breakdown(pipeline, run) -> dict:
    """Seconds in the T5 encoder, the denoiser and VAE decoding during one ``run`` (``flow_grpo.breakdown``)."""
    parts = pipeline.components  # a name -> module dict on both omnispec's and diffusers' pipelines
    return module_seconds({"t5_encode_s": (parts["text_encoder_3"], "forward"),
                           "denoiser_s": (parts["transformer"], "forward"), "vae_decode_s": (parts["vae"], "decode")},
                          run)


def denoiser_bound(base: FlowGRPOLoop, images: int, steps: int, split: dict, loop_s: float) -> dict:
    """How far from the hardware the loop's denoiser already is: its FLOPs (counted on one CFG forward of one
    sample), its achieved TFLOP/s in the breakdown, and the largest speed-up any bf16 rollout could reach on
    this GPU, if its denoiser ran at the measured matmul ceiling and nothing else took time."""
    from torch.utils.flop_counter import FlopCounterMode

    sample = base.sample(prompts("flops", 1), seed=0)
    counter = FlopCounterMode(display=False)
    # eager: dynamo skips a compiled frame run under a dispatch mode for good (harness.flops_per_step)
    with torch.compiler.set_stance("force_eager"), counter, torch.no_grad():
        base._forward(sample["latents"][:, 0], sample["timesteps"][0], sample["pe"], sample["pooled"])
    flops = float(counter.get_total_flops()) * images * steps
    ceiling = harness.matmul_ceiling()
    return {"config": "denoiser bound", "denoiser_tflop": flops / 1e12,
            "loop_denoiser_tflops_per_s": flops / split["denoiser_s"] / 1e12, "matmul_ceiling_tflops": ceiling / 1e12,
            "loop_denoiser_mfu": flops / split["denoiser_s"] / ceiling,
            "max_speedup_over_loop_bf16": loop_s / (flops / ceiling)}


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--window", type=int, default=3,
                        help="stochastic steps (Flow-GRPO fast's sde_window_size; 0: every step but the last)")
    parser.add_argument("--window-start", type=int, default=0)
    parser.add_argument("--outside-every", type=int, default=2,
                        help="window-aware rows: compute one step in K outside the window (1: no such rows)")
    parser.add_argument("--compress", type=float, default=1.0,
                        help="below 1: a side with DPM-Solver++ after the window on this fraction of its points")
    parser.add_argument("--baseline-batch", type=int, default=8)
    parser.add_argument("--replay-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="time the eager sides (--no-eager: only the compiled and quantized rows, for a call "
                             "with less time; implies --no-details)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure omnispec with policies.compile.mode=regional (after the eager runs)")
    parser.add_argument("--compile-repeats", type=int, default=2)
    parser.add_argument("--compiled-loop-only", action="store_true",
                        help="of the compiled rows, time only the loop over the compiled blocks (the peer of the "
                             "--rollout-compile and --quantized-base rows, in a call with less time)")
    parser.add_argument("--rollout-compile", default="", metavar="VARIANT[,VARIANT...]",
                        help="also time omnispec's rollout under these compile variants, each a mode with options "
                             "after '+' (e.g. regional+cudagraphs), built after the compiled rows (--smoke: regional "
                             "on aot_eager, the options dropped)")
    parser.add_argument("--details", action=argparse.BooleanOptionalAction, default=True,
                        help="per-module breakdown, the denoiser bound, and replay timing")
    parser.add_argument("--sdpa-variant", action="store_true",
                        help="also time omnispec with attention forced to sdpa (auto's choice is in the breakdown)")
    parser.add_argument("--replay-check-only", action="store_true",
                        help="only roll out once and replay --replay-batch of the samples (issue 15's bound); no timing")
    parser.add_argument("--quantized-base", metavar="METHOD[:GRANULARITY]", default=None,
                        help="add rows with the denoiser's base weights quantized by omnispec (e.g. fp8_dynamic:row) "
                             "under a fresh LoRA of the same shape, regional compile: rollout time, replay with "
                             "gradients, replay ratio (--smoke: int8_weight_only)")
    parser.add_argument("--quantized-compile", default="regional", metavar="VARIANT[,VARIANT...]",
                        help="compile variants of the --quantized-base rows, as in --rollout-compile (e.g. "
                             "regional,regional+cudagraphs), each on a fresh quantized copy; the gradient replay runs "
                             "through the last (--smoke: regional on aot_eager)")
    parser.add_argument("--quantized-exclude", default="", metavar="MODULE[,MODULE...]",
                        help="modules the --quantized-base policy leaves in bf16 (its quantization.exclude), e.g. "
                             "SD3's modulation linears: norm1,norm1_context,norm_out")
    parser.add_argument("--quantized-first", action="store_true",
                        help="time the --quantized-base rollout rows before the compiled ones (in a call with less "
                             "time, the rows whose cold compile is longest get the time first); the gradient replay, "
                             "whose backward compiles anew, still comes last")
    parser.add_argument("--profile-rollout", action="store_true",
                        help="after each --quantized-base variant's breakdown, profile one of its rollouts: device "
                             "time by kernel kind (fp8 and bf16 matmuls, attention, inductor's fused kernels) and the "
                             "largest kernels")
    inductor_passes.add_argument(parser)


def _build(mods: dict, overrides: list[str]):
    import omnispec

    return omnispec.build(harness.ROOT / "specs" / "sd3.5-medium.yaml", components=mods, device=harness.DEVICE,
                          overrides=overrides)


def benchmark(args, results: harness.Results) -> None:
    inductor_passes.install(args.inductor_passes)
    if args.smoke:  # tiny models; 5 steps: a window of 3, then one computed and one reused Euler step; one repeat
        args.size, args.prompts, args.group, args.repeats, args.replay_batch = 64, 2, 2, 1, 2
        args.steps, args.window, args.compile_repeats = 5, min(args.window, 3), 1
    mods = sd3_components()
    length = args.window or args.steps - 1
    window = range(args.window_start, args.window_start + length)
    sampler = {"kind": "sde", "noise_level": NOISE_LEVEL,
               "window": {"kind": "fixed", "start": args.window_start, "length": length}}
    fast_sampler = sampler | {"outside_window": {"compute_every": args.outside_every}}
    # The bundled spec's schedule is the checkpoint scheduler's own (kind: scheduler), as Flow-GRPO steps it.
    overrides = ["runtime.progress=false", "recipe.phases.0.guidance.terms=[{kind: cfg, scale: 4.5}]"]
    request = dict(height=args.size, width=args.size, steps=args.steps, max_sequence_length=MAX_TOKENS)
    pipe = _build(mods, overrides)
    base = FlowGRPOLoop(mods, args.size, args.steps, window)
    check_sigmas(pipe, base.pipe.scheduler, args.steps, request)
    n = args.prompts * args.group
    results.header["setup"] = {k: v for k, v in vars(args).items() if k != "json"} | {"images": n,
                                                                                     "window_steps": list(window)}
    save = results.save

    def run_base(tag: str):
        rows = [p for p in prompts(tag, args.prompts) for _ in range(args.group)]
        out = None
        for i in range(0, n, args.baseline_batch):
            out = base.sample(rows[i:i + args.baseline_batch], seed=i)
        return out

    def run_ours(tag: str, p=pipe, s=sampler):
        return p.rollout(prompts(tag, args.prompts), group_size=args.group, seed=0, sampler=s, **request)

    if args.replay_check_only:
        save(replay_ratio(pipe, run_ours, args.replay_batch, "replay ratio check"))
        return
    sides = {"flow-grpo loop (diffusers)": run_base, "omnispec rollout": run_ours}
    if args.outside_every > 1:
        sides[f"omnispec rollout, window-aware (every {args.outside_every})"] = lambda tag: run_ours(tag, s=fast_sampler)
    if args.compress < 1:  # MixGRPO-Flash: on omnispec's flow_match schedule (shift 3, the scheduler's sigmas)
        flash = _build(mods, [*overrides, "recipe.phases.0.schedule={kind: flow_match, shift: 3.0}"])
        flash_sampler = sampler | {"outside_window": {"solver": "dpmsolver++", "compress": args.compress}}
        sides[f"omnispec rollout, MixGRPO-Flash (compress {args.compress})"] = lambda tag: run_ours(tag, flash,
                                                                                                   flash_sampler)
    if args.sdpa_variant:
        sdpa = _build(mods, [*overrides, "policies.attention.default=sdpa"])
        sides["omnispec rollout, attention sdpa"] = lambda tag: run_ours(tag, sdpa)
    with torch.no_grad():  # warm-up: kernels, allocator, autotuning, auto attention's trials at the timed shapes
        base.sample(prompts("w", 2), seed=0)
        for label, side in sides.items() if args.eager else ():
            side("w")
    times: dict[str, list[float]] = {label: [] for label in sides} if args.eager else {}
    for r in range(args.repeats if args.eager else 0):  # interleaved, so drift hits every side alike
        with torch.no_grad():
            for i, (label, side) in enumerate(sides.items()):
                times[label].append(timed(side, f"{i}-{r}")[0])
    for label, samples in times.items():
        med = statistics.median(samples)
        save({"config": label, "seconds": med, "images_per_s": n / med, "samples_s": samples})
    if args.details and args.eager:
        details(args, pipe, base, mods, n, run_ours, run_base, save, statistics.median(times["flow-grpo loop (diffusers)"]))
    quantized = None
    if args.quantized_base and args.quantized_first:  # its gradient rows after the loop's, so the ratio comes first
        quantized = quantized_rows(args, mods, overrides, n, run_ours, save)
    if args.compile:
        smoke_backend = ["policies.compile.backend=aot_eager"] if args.smoke else []  # inductor's CPU codegen: minutes
        compiled_rows(args, _build(mods, [*overrides, "policies.compile.mode=regional", *smoke_backend]),
                      n, run_ours, run_base, save, fast_sampler)
    if args.rollout_compile:
        variant_rows(args, mods, overrides, n, run_ours, save)
    if args.quantized_base and not args.quantized_first:
        quantized = quantized_rows(args, mods, overrides, n, run_ours, save)
    if quantized is not None:
        quantized_gradient_rows(args, *quantized, save)
    table(results.rows, n)


def table(rows: list[dict], n: int) -> None:
    # --no-eager --no-compile (only the quantized rows) times no loop: the table then has no ratio column filled
    loop = next((row for row in rows if row["config"].startswith("flow-grpo loop")), None)
    print(f"| config | s per {n} images | images/s | vs {loop['config'] if loop else 'no loop timed'} |")
    for row in rows:
        if "images_per_s" in row:
            ratio = f"{loop['seconds'] / row['seconds']:.2f}x" if loop else ""
            print(f"| {row['config']} | {row['seconds']:.2f} | {row['images_per_s']:.2f} | {ratio} |")
        elif "ms_per_step" in row:
            print(f"| {row['config']} | {row['ms_per_step']:.1f} ms per step of {row['samples_per_replay']} samples | | |")


def details(args, pipe, base, mods, n, run_ours, run_base, save, loop_s: float) -> None:
    """Where the time goes (per module), how far the loop's denoiser is from the hardware, and replay."""
    save({"config": "omnispec breakdown", **breakdown(pipe, lambda: run_ours("bd")),
          "auto_attention": pipe.explain(as_dict=True)["attention"]})
    base_split = breakdown(base.pipe, lambda: run_base("bd"))
    save({"config": "baseline breakdown", **base_split})
    save(denoiser_bound(base, n, args.steps, base_split, loop_s))

    # replay: one stored step of replay_batch samples, forward with gradients + backward, both sides
    with torch.no_grad():
        ro = run_ours("replay")
        ref = base.sample(prompts("replay", 1) * args.replay_batch, seed=0)
    part = ro.select(range(args.replay_batch))
    first = base.window.start
    for label, step in (("omnispec log_prob", lambda k: pipe.log_prob(part, steps=[k], grad=True).log_probs),
                        ("flow-grpo replay (diffusers)", lambda k: base.replay_step(ref, first + k))):
        samples = []
        w = len(base.window)
        for k in [0, w // 2, w - 1, 0, w // 2, w - 1]:  # positions in the window
            samples.append(timed(lambda fn, at: fn(at).sum().backward(), step, k)[0])
        med = statistics.median(samples[1:])  # the first includes autograd warm-up
        save({"config": label, "ms_per_step": med * 1e3, "samples_per_replay": args.replay_batch,
              "samples_ms": [s * 1e3 for s in samples]})
        mods["transformer"].zero_grad(set_to_none=True)
    save(replay_ratio(pipe, lambda tag: ro, args.replay_batch, "replay ratio check"))
    save(replay_ratio(pipe, lambda tag: ro, args.replay_batch, "replay ratio check, with gradients", grad_steps=[0, 1]))


def replay_ratio(pipe, run_ours, batch: int, label: str, grad_steps: list[int] | None = None) -> dict:
    """Replay the first ``batch`` samples of a rollout (so the forwards group rows differently than the
    rollout's did) and report how far exp(replayed - stored log-prob) is from 1; with ``grad_steps``, those window
    steps replayed with gradients, as a trainer's first ratio reads them (their graphs held at once: a few steps)."""
    with torch.no_grad():
        rollout = run_ours("replay")
    part = rollout.select(range(batch))
    return {"config": label, "max_abs_ratio_minus_1": ratio_off(pipe, part, grad_steps),
            "replayed_samples": len(part.log_probs), "rollout_samples": len(rollout.log_probs),
            "latent_dtype": str(rollout.latents.dtype)}


def ratio_off(pipe, part, grad_steps: list[int] | None = None, exact: bool = True) -> float:
    """max |exp(replayed - stored log-prob) - 1| over ``part``: every window step without gradients, or
    ``grad_steps`` with them (``exact``: as ``log_prob`` takes it)."""
    if grad_steps is None:
        replayed, stored = pipe.log_prob(part, grad=False).log_probs.cpu(), part.log_probs
    else:
        replayed = pipe.log_prob(part, steps=grad_steps, grad=True, exact=exact).log_probs.detach().cpu()
        stored = part.log_probs[:, grad_steps]
    return (replayed - stored).exp().sub(1).abs().max().item()


def compiled_rows(args, compiled, n, run_ours, run_base, save, fast_sampler) -> None:
    """omnispec with ``compile: regional``, and the loop over the same compiled blocks (regional compile is
    diffusers' ``compile_repeated_blocks`` on the shared transformer, so the loop gets it too): how much of
    the gain is compilation, which any loop could add, and how much is omnispec's batching; then omnispec
    compiled and window-aware."""
    aware = f"omnispec rollout + regional compile, window-aware (every {args.outside_every})"
    if args.compiled_loop_only:
        with torch.no_grad():
            first_loop, _ = timed(run_base, "cwb")  # compiles the blocks the build above marked
            times = [timed(run_base, f"cb{r}")[0] for r in range(args.compile_repeats)]
        med = statistics.median(times)
        save({"config": "flow-grpo loop + compile_repeated_blocks", "seconds": med, "images_per_s": n / med,
              "samples_s": times, "first_call_s": first_loop})
        return
    with torch.no_grad(), harness.CompileWatch() as watch:
        first, _ = timed(run_ours, "cw", compiled)  # compiles every shape the batching uses
        first_loop, _ = timed(run_base, "cwb")
        samples: dict[str, list[float]] = {"omnispec rollout + regional compile": [],
                                           "flow-grpo loop + compile_repeated_blocks": []}
        if args.outside_every > 1:
            samples[aware] = []
        for r in range(args.compile_repeats):
            samples["omnispec rollout + regional compile"].append(timed(run_ours, f"c{r}", compiled)[0])
            samples["flow-grpo loop + compile_repeated_blocks"].append(timed(run_base, f"cb{r}")[0])
            if args.outside_every > 1:
                samples[aware].append(timed(run_ours, f"ca{r}", compiled, fast_sampler)[0])
        compiled_ro = run_ours("creplay", compiled)
        aware_ro = run_ours("careplay", compiled, fast_sampler) if args.outside_every > 1 else None
    firsts = (first, first_loop, None)
    for (label, times), first_s in zip(samples.items(), firsts):
        med = statistics.median(times)
        save({"config": label, "seconds": med, "images_per_s": n / med, "samples_s": times}
             | ({"first_call_s": first_s} if first_s is not None else {})
             | ({"dynamo": watch.summary()} if label.startswith("omnispec") else {}))
    # replay through the same compiled blocks (no grad: the inference graphs), other micro-batch
    save(replay_ratio(compiled, lambda tag: compiled_ro, args.replay_batch, "replay ratio check, compiled"))
    # the training graphs compile here: a minute on the GPU
    save(replay_ratio(compiled, lambda tag: compiled_ro, args.replay_batch, "replay ratio check, compiled, with "
                      "gradients", grad_steps=[0, 1]))
    if aware_ro is not None:
        save(replay_ratio(compiled, lambda tag: aware_ro, args.replay_batch,
                          "replay ratio check, compiled, window-aware"))


# compile options that are inductor's alone, which --smoke's aot_eager backend drops
INDUCTOR_OPTIONS = ("cudagraphs", "autotune", "eager_rounding", "fixed_reductions")


def _variant_overrides(args, variant: str) -> list[str]:
    """A compile variant's overrides (``regional+cudagraphs``, ``regional+vae``); --smoke keeps its mode and its
    other options on aot_eager, inductor's options dropped (inductor's CPU codegen takes minutes, and CUDA graphs
    need CUDA)."""
    if args.smoke:
        mode, *options = variant.split("+")
        kept = [o for o in options if o.removeprefix("no_").split("=")[0] not in INDUCTOR_OPTIONS]
        return [*harness.compile_overrides("+".join([mode, *kept])), "policies.compile.backend=aot_eager"]
    return harness.compile_overrides(variant)


def variant_rows(args, mods: dict, overrides: list[str], n: int, run_ours, save) -> None:
    """omnispec's exact rollout under further compile variants (``regional+cudagraphs``: CUDA graphs for the
    fixed-shape block calls), each in a build of its own over the same modules (which undoes the earlier builds'
    compilation), timed as the regional row and replayed through the same graphs."""
    for variant in args.rollout_compile.split(","):
        pipe = _build(mods, [*overrides, *_variant_overrides(args, variant)])
        label = f"omnispec rollout + {variant.replace('+', ' + ')} compile"
        with torch.no_grad(), harness.CompileWatch() as watch:
            first, _ = timed(run_ours, f"v{variant}", pipe)
            times = [timed(run_ours, f"v{variant}{r}", pipe)[0] for r in range(args.compile_repeats)]
            ro = run_ours(f"v{variant}replay", pipe)
        med = statistics.median(times)
        save({"config": label, "seconds": med, "images_per_s": n / med, "samples_s": times, "first_call_s": first,
              "dynamo": watch.summary()})
        save(replay_ratio(pipe, lambda tag, ro=ro: ro, args.replay_batch, f"replay ratio check, {variant}"))


def quantized_rows(args, mods: dict, overrides: list[str], n: int, run_ours, save) -> tuple:
    """Rollouts on a quantized base with a trainable LoRA beside it (the trained weights stay bf16; rollout and
    replay both run through the same quantized base, so the ratio stays exactly 1): for each ``--quantized-compile``
    variant, a copy of the transformer without its LoRA is quantized by omnispec's policy at build, then given a
    fresh LoRA of the benchmark's shape (quantizing first keeps torchao off the LoRA's own linears; peft wraps the
    quantized linears). Returns the last variant's pipeline and replay part, for the gradient rows."""
    method, _, granularity = ("int8_weight_only" if args.smoke else args.quantized_base).partition(":")
    policy, base = harness.quantized_transformer(method, granularity or None,
                                                 [m for m in args.quantized_exclude.split(",") if m])
    last = None
    for variant in args.quantized_compile.split(","):
        last = None  # the earlier variant's quantized copy goes before the next one is made
        harness.free_device_memory()
        last = _quantized_variant_rows(args, mods, [*overrides, policy], variant, run_ours, save, base, n)
    return (*last, method)


def _quantized_variant_rows(args, mods: dict, overrides: list[str], variant: str, run_ours, save, base: str,
                            n: int) -> tuple:
    from peft import LoraConfig

    twin = copy.deepcopy(mods["transformer"])
    twin.delete_adapters(twin.active_adapters())
    pipe = _build({**mods, "transformer": twin}, [*overrides, *_variant_overrides(args, variant)])
    pipe.components["transformer"].add_adapter(LoraConfig(r=32, lora_alpha=64, target_modules=SD3_LORA_TARGETS))
    label = f"omnispec rollout, {base} base + bf16 LoRA + {variant.replace('+', ' + ')} compile"
    print(f"[{label}] built; first rollout (compiles) starts", flush=True)  # a cut call still shows how far it got
    with torch.no_grad(), harness.CompileWatch() as watch:
        # the samples go to a file as they come, since a first rollout once outlasted its call's 575 s
        with harness.StackSampler(dump_to=harness.stacks_file(args.json, f"first rollout {variant}")) as stacks:
            first, _ = timed(run_ours, "qw", pipe)
        print(f"[{label}] first rollout {first:.1f} s: {watch.summary()}", flush=True)
        save({"config": f"{label}: where the first rollout's time went", "first_call_s": first, **stacks.top()})
        times = [timed(run_ours, f"q{r}", pipe)[0] for r in range(args.compile_repeats)]
        ro = run_ours("qreplay", pipe)
    med = statistics.median(times)
    save({"config": label, "seconds": med, "images_per_s": n / med, "samples_s": times, "first_call_s": first,
          "dynamo": watch.summary()})
    save({"config": f"{label}: breakdown", **breakdown(pipe, lambda: run_ours("qbd", pipe))})
    if args.profile_rollout:
        save({"config": f"{label}: device time of one rollout", **profiled_rollout(lambda: run_ours("qprof", pipe))})
    save(replay_ratio(pipe, lambda tag: ro, args.replay_batch, f"replay ratio check, {base} base, {variant}"))
    return pipe, ro.select(range(args.replay_batch))


def quantized_gradient_rows(args, pipe, part, method: str, save) -> None:
    """Replay with gradients into the LoRA through the quantized base (its backward compiles anew): time per step,
    which LoRA weights got gradients, and the ratio a trainer reads; the same with ``exact=False`` (one forward,
    the training graphs' own values)."""
    batchings = []

    def step(k: int, exact: bool) -> None:
        replay = pipe.log_prob(part, steps=[k], grad=True, exact=exact)
        replay.log_probs.sum().backward()
        batchings.append(replay.batching)  # the micro-batch log_prob chose from the free memory

    try:
        samples = [timed(step, k, True)[0] for k in (0, 0, 1, 1)]
        one_forward = [timed(step, k, False)[0] for k in (0, 1, 1)]
        lora = [p.grad for name, p in pipe.components["transformer"].named_parameters() if "lora_B" in name]
        save({"config": f"omnispec log_prob with gradients, {method} base", "ms_per_step": statistics.median(
            samples[1:]) * 1e3, "samples_per_replay": args.replay_batch, "samples_ms": [s * 1e3 for s in samples],
              "ms_per_step_one_forward": statistics.median(one_forward) * 1e3,
              "lora_b_grads_nonzero": sum(g is not None and bool(g.abs().sum() > 0) for g in lora), "lora_b": len(lora),
              "batching": {"micro_batch": batchings[-1].micro_batch, "recompute": batchings[-1].recompute,
                           "why": batchings[-1].why},
              "max_abs_ratio_minus_1": ratio_off(pipe, part, grad_steps=[0, 1]),  # what a trainer's ratio reads
              "max_abs_ratio_minus_1_one_forward": ratio_off(pipe, part, grad_steps=[0, 1], exact=False)})
    except Exception as exc:  # noqa: BLE001 - the rollout rows above stand
        save({"config": f"omnispec log_prob with gradients, {method} base",
              "error": f"{type(exc).__name__}: {' | '.join(str(exc).strip().splitlines()[:4])[:600]}"})


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark)


if __name__ == "__main__":
    main()
