"""RL rollout engine on one GPU: rollout samples/s with 1 and 2 workers, weight update seconds per GB, sleep/wake.
No peer: the engine's own configurations are the comparison (1 worker against 2 sharing the GPU, with the trainer
resident on the same GPU and a sleep / trainer step / wake cycle between rollout phases).

``python -m benchmarks.gpu_engine [--model sd3|wan_ti2v] [--workers 1,2] [--prompts 4 --group 4 --requests 4
--steps 10 --size 512 --frames 17 --window 3 --bucket-mb 256] [--json FILE]`` (needs CUDA and Ray; ``--smoke``:
tiny models on the CPU, 2 Ray CPU workers, to check the script only.)

Random bf16 weights at real sizes with a rank-32 LoRA, an SDE window of ``--window`` steps from step 0. ``sd3``
(the image family): SD3.5-medium's sizes, the LoRA on the attention projections as ``gpu_rollout``, CFG 4.5, 512².
``wan_ti2v`` (the video family): Wan2.2 TI2V-5B's transformer, the LoRA on the self- and cross-attention
projections, the spec's CFG 5, videos of ``--frames`` frames at ``--size`` (default 384) square, SDE steps on
UniPC's sigmas (``multistep: euler``, as Flow-GRPO's Wan pipeline steps). The trainer (this process) holds the
same model on the GPU throughout, and every side decodes a request's samples one at a time
(``policies.vae.slicing``), so that two workers and the trainer fit an 80 GB card. For each worker count, an
``omnispec.rl.RolloutEngine`` starts (each worker builds its model inside its Ray actor, the GPU split evenly between
them), then:

- full update: the trainer's whole transformer state dict (LoRA included) into every worker, in buckets of
  ``--bucket-mb``: seconds, GB, seconds per GB. The workers then hold the trainer's weights;
- rollout: ``--requests`` requests of ``--prompts x --group`` samples submitted as one batch after one warm-up
  request: samples/s from submit to the last rollout;
- LoRA update: new LoRA B weights (set in the trainer too), in buckets: seconds, MB, seconds per GB;
- replay: the trainer's ``log_prob`` (no gradients) on one engine rollout: max |ratio - 1| (0.0 expected: the
  trainer and the workers run the same weights and code on the same kind of device);
- sleep / trainer step / wake: ``engine.sleep()`` (workers' weights to the host), a trainer replay of one window
  step with gradients and its backward, ``engine.wake()``, then the rollout batch again: seconds of each, device
  bytes the workers freed, samples/s after the wake.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from . import harness, workloads
from .flow_grpo import NOISE_LEVEL
from .workloads import SD3_LORA_TARGETS, WAN_LORA_TARGETS, with_lora

LORA_RANK, LORA_ALPHA = 32, 64

# spec, modules (without a LoRA), LoRA targets, spec overrides, whether requests take frames, sampler fields, default
# size
MODELS = {
    "sd3": {"spec": "sd3.5-medium.yaml", "components": functools.partial(workloads.sd3_components, lora=False),
            "lora": SD3_LORA_TARGETS,
            "overrides": ["recipe.phases.0.guidance.terms=[{kind: cfg, scale: 4.5}]"], "video": False,
            "sampler": {}, "size": 512},
    "wan_ti2v": {"spec": "wan2.2-ti2v-5b.yaml", "components": workloads.wan_ti2v_components,
                 "lora": WAN_LORA_TARGETS, "overrides": [], "video": True,
                 "sampler": {"multistep": "euler"}, "size": 384},
}


def engine_components(model: str, smoke: bool) -> dict:
    """``model``'s modules with a fresh rank-32 LoRA on its attention projections, the rest frozen; what a worker
    builds in its own Ray actor (so the smoke switch is made there too) and what the trainer holds."""
    if smoke and not harness.SMOKE:
        harness.enable_smoke()
    return with_lora(MODELS[model]["components"](), MODELS[model]["lora"], LORA_RANK, LORA_ALPHA)


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="sd3")
    parser.add_argument("--workers", default="1,2", help="worker counts to measure, comma-separated")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per request")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--requests", type=int, default=4, help="requests per measured batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, help="square output size (default: the model's)")
    parser.add_argument("--frames", type=int, default=17, help="a video model's frames")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0)


def _request(args, tag: str, i: int) -> dict:
    model = MODELS[args.model]
    sampler = {"kind": "sde", "noise_level": NOISE_LEVEL, "window": {"kind": "fixed", "start": 0,
                                                                     "length": args.window}, **model["sampler"]}
    video = {"frames": args.frames} if model["video"] else {}
    return {"prompts": [f"{tag} prompt {i} {j}" for j in range(args.prompts)], "group_size": args.group,
            "seed": i, "sampler": sampler, "height": args.size, "width": args.size, "steps": args.steps, **video}


def _rollout_batch(engine, args, tag: str) -> dict:
    handle = engine.submit([_request(args, tag, i) for i in range(args.requests)])
    engine.get(handle)
    return {k: round(v, 4) for k, v in handle.stats.items()}


def _trainer_lora_state(transformer: torch.nn.Module, seed: int) -> dict:
    """New LoRA B weights in the trainer's adapter (as a training step would leave them), as a state dict."""
    from peft import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.device, p.dtype))
    return get_peft_model_state_dict(transformer, adapter_name="default")


def _ratio_off(trainer, ro) -> float:
    replayed = trainer.log_prob(ro, grad=False).log_probs.cpu()
    return (replayed - ro.log_probs).exp().sub(1).abs().max().item()


def _trainer_step(trainer, ro) -> float:
    """One replayed window step with gradients and its backward: the trainer's use of the GPU between phases."""
    for name, p in trainer.components["transformer"].named_parameters():
        p.requires_grad_("lora_" in name)  # the trainer trains the LoRA
    harness.sync()
    start = time.perf_counter()
    part = ro.select(range(min(2, len(ro.prompts))))
    replay = trainer.log_prob(part, steps=[0], grad=True, micro_batch=1)
    replay.log_probs.sum().backward()
    trainer.components["transformer"].zero_grad(set_to_none=True)
    harness.sync()
    return time.perf_counter() - start


def _start_ray(smoke: bool):
    import ray

    path = os.pathsep.join([str(harness.ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    ray.init(num_cpus=2 if smoke else None, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    return ray


def benchmark(args, results: harness.Results) -> None:
    try:
        import ray
    except ImportError:
        raise harness.UsageError("needs Ray: pip install 'omnispec-diffusion[ray]'") from None
    import omnispec
    from omnispec.rl import set_lora
    from omnispec.rl.engine import RolloutEngine

    model = MODELS[args.model]
    args.size = args.size or model["size"]
    if args.smoke:  # tiny models: two requests of 2 x 2 samples at 64 px (5 frames), 4 steps
        args.size, args.prompts, args.group, args.requests, args.steps, args.window = 64, 2, 2, 2, 4, 2
        args.frames, args.bucket_mb = 5, 0.05  # several buckets even for the tiny transformer
    counts = [int(n) for n in str(args.workers).split(",") if n.strip()]
    if not counts or min(counts) < 1:
        raise harness.UsageError(f"--workers: expected counts >= 1, got {args.workers!r}")
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    results.header |= {"device": harness.device_name(), "setup": {k: v for k, v in vars(args).items() if k != "json"}}
    # the VAE decodes a request's samples one at a time: a 16-sample decode's feature maps beside each worker's weights
    # leave no room for a second worker and the trainer on an 80 GB card
    overrides = ["runtime.progress=false", "policies.vae.slicing=true", *model["overrides"]]
    spec = str(harness.ROOT / "specs" / model["spec"])
    trainer = omnispec.build(spec, components=engine_components(args.model, args.smoke), device=harness.DEVICE,
                             overrides=overrides)
    transformer = trainer.components["transformer"]
    full_state = {k: v.detach() for k, v in transformer.state_dict().items()}
    lora_meta = {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": model["lora"]}
    ray = _start_ray(args.smoke)
    try:
        for n in counts:
            config = f"workers={n}"
            gpus = 0.0 if args.smoke else 1.0 / n
            harness.free_device_memory()  # the trainer's allocator cache from the last count's replays
            start = time.perf_counter()
            try:
                engine = RolloutEngine(spec, n, num_gpus_per_worker=gpus, num_cpus_per_worker=1.0,
                                       bucket_bytes=bucket_bytes, device=harness.DEVICE, overrides=overrides,
                                       make_components=functools.partial(engine_components, args.model, args.smoke))
            except Exception as exc:  # noqa: BLE001 - e.g. the workers do not fit beside the trainer: a row says so
                results.save({"config": config, "error": f"start: {_error(exc)}"})
                continue
            results.save({"config": config, "event": "start", "seconds": time.perf_counter() - start,
                          "device_gb_in_use": _device_gb_in_use()})
            try:
                _measure(engine, args, config, trainer, transformer, full_state, lora_meta, set_lora, results)
            except Exception as exc:  # noqa: BLE001 - a row says what failed; the other worker counts still run
                results.save({"config": config, "error": _error(exc)})
            finally:
                engine.shutdown()
    finally:
        ray.shutdown()


def _error(exc: Exception) -> str:
    """An error row's text: the exception's type and the end of its message, where a Ray task error puts the
    worker's own exception after the remote traceback."""
    return f"{type(exc).__name__}: {str(exc)[-800:]}"


def _device_gb_in_use() -> float:
    """GB in use on the GPU by every process (the trainer and the workers), as the driver counts it."""
    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


def _update_row(config: str, event: str, report) -> dict:
    return {"config": config, "event": event, "version": report.version, "tensors": report.tensors,
            "gb": report.bytes / 1e9, "buckets": report.buckets, "seconds": report.seconds,
            "seconds_per_gb": report.seconds_per_gb, "apply_seconds": report.apply_seconds}


def _measure(engine, args, config, trainer, transformer, full_state, lora_meta, set_lora, results) -> None:
    results.save(_update_row(config, "full update", engine.update_weights(full_state)))
    engine.rollout([_request(args, "warm-up", 0)])  # first forwards: allocator, kernels
    results.save({"config": config, "event": "rollout", **_rollout_batch(engine, args, "rollout")})
    lora = _trainer_lora_state(transformer, seed=1)
    set_lora(trainer, "default", lora, metadata=lora_meta)  # the trainer's own weights go the same way
    results.save(_update_row(config, "lora update", engine.set_lora("default", lora, metadata=lora_meta)))
    (ro,) = engine.rollout([_request(args, "replay", 0)])
    results.save({"config": config, "event": "replay", "policy_version": ro.policy_version,
                  "max_abs_ratio_minus_1": _ratio_off(trainer, ro)})
    start = time.perf_counter()
    slept = engine.sleep()
    sleep_s = time.perf_counter() - start
    trainer_s = _trainer_step(trainer, ro)
    start = time.perf_counter()
    engine.wake()
    wake_s = time.perf_counter() - start
    freed = sum(w.get("allocated_before", 0) - w["allocated_bytes"] for w in slept)
    results.save({"config": config, "event": "sleep, trainer step, wake", "sleep_seconds": sleep_s,
                  "trainer_step_seconds": trainer_s, "wake_seconds": wake_s, "freed_gb": freed / 1e9,
                  "moved_gb": sum(w["moved_bytes"] for w in slept) / 1e9,
                  **_rollout_batch(engine, args, "after wake")})


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, needs_cuda=True,
                          smoke="tiny models on the CPU, 2 Ray CPU workers (checks the script only)")


if __name__ == "__main__":
    main()
