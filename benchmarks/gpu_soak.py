"""Soak: one long-lived pipeline through many mixed requests. Does its memory stop growing, does a repeat match?
No peer: the pipeline's own memory after warm-up, and a repeated request's first output, are the reference.

``python -m benchmarks.gpu_soak [--model flux|wan_ti2v] [--requests 200 --steps 4,2 --sizes 512,768,1024]
[--set OVERRIDE ...] [--json FILE]``  (needs CUDA; ``--set policies.compile.mode=regional`` soaks the compiled path)
(``--smoke``: tiny models on the CPU, to check the script only; ``--digits``: the digits soak of
``tests/test_soak.py`` on the CPU, resident memory and live objects instead of device memory.)

``flux``: FLUX.1-dev at its real transformer size with random bf16 weights (``benchmarks.workloads
.flux_components``: tiny text encoders with the real widths, so a T5 encoding of 512 tokens is 4 MiB as in the real
model). ``wan_ti2v``: Wan2.2 TI2V-5B's transformer at its real size, videos of ``--frames`` frames at small sizes
(its defaults: 256 and 384 square, 9 and 17 frames, with CFG). The requests mix sizes, prompts (repeated, and new ones that churn the prompt-encoding cache), batch sizes,
guidance scales and sequence lengths with refused requests, LoRA swaps (rank 16 on the attention projections),
SDE rollouts followed by replays (half of them with gradients and a backward), and a reference request that must
return the identical array each time. Device memory is sampled after every ``--every`` requests: allocated
(steady), the peak since the last sample, reserved; the prompt-encoding cache's bytes against its bound.

``soak`` is the driver; ``tests/test_soak.py`` runs ``digits_soak`` (1,000 requests) and checks its curve.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import harness, workloads

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "digit", "the", "a", "cat",
         "photo", "red", "blue", "car", "snow", "fruit", "bowl", "painting", "city", "night"]


def random_lora(module: torch.nn.Module, targets: Sequence[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT-layout LoRA state dict (``<module>.lora_A.weight`` / ``lora_B``) for every ``nn.Linear`` whose
    name ends with one of ``targets``, small random values, on the module's device and dtype."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and name.split(".")[-1] in targets:
            a = torch.randn(rank, sub.in_features, generator=gen) * 0.02
            b = torch.randn(sub.out_features, rank, generator=gen) * 0.02
            param = sub.weight
            state[f"{name}.lora_A.weight"] = a.to(param.device, param.dtype)
            state[f"{name}.lora_B.weight"] = b.to(param.device, param.dtype)
    return state


def rss_bytes() -> int:
    """Resident memory of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def process_memory() -> dict[str, int]:
    """Resident bytes, and the Python objects and torch tensors alive (a leak too small to move the resident
    size still adds objects)."""
    objects = gc.get_objects()
    tensors = sum(issubclass(type(o), torch.Tensor) for o in objects)
    return {"rss": rss_bytes(), "objects": len(objects), "tensors": tensors}


def cuda_memory() -> dict[str, int]:
    """Allocated now, the peak since the last call, reserved (bytes); resets the peak."""
    torch.cuda.synchronize()
    out = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated(),
           "reserved": torch.cuda.memory_reserved()}
    torch.cuda.reset_peak_memory_stats()
    return out


def soak(pipe: Any, count: int, *, sizes: Sequence[int], steps: Sequence[int], batch_sizes: Sequence[int],
         guidance_scales: Sequence[float], sequence_lengths: Sequence[int], loras: Sequence[dict], lora_scales:
         Sequence[float] = (0.0, 0.5, 1.0), rollout_sampler: dict | None = None, memory: Callable[[], Any] = rss_bytes,
         every: int = 50, seed: int = 0, log: Callable[[str], None] | None = None,
         frames: Sequence[int] = ()) -> dict[str, Any]:
    """Run ``count`` mixed requests through ``pipe``; return what was run, memory samples and the repeat check.
    ``frames``: frame counts to draw from, for a video model (the first is the reference's and the rollouts').

    Every ``every`` requests, after ``gc.collect()``, ``memory()`` is sampled. The reference request (the first
    size and step count, guidance and adapters off) is compared bit for bit with its first output each time.
    """
    from omnispec.rl import reference, scale_lora, set_lora, update_weights
    from omnispec.spec import SpecError

    rng = random.Random(seed)
    pool = [" ".join(rng.sample(WORDS, rng.randint(1, 4))) for _ in range(24)]
    denoiser = pipe.components[pipe.spec.recipe.phases[0].denoiser]
    name, param = next(iter(denoiser.named_parameters()))
    kinds = ["generate", "unique", "refused", "rollout", "lora", "repeat"]
    weights = [50, 10, 10, 12, 10, 8]
    counts = dict.fromkeys(kinds, 0)
    seconds = dict.fromkeys(kinds, 0.0)
    samples: list[dict[str, Any]] = []
    reference_array = None
    cache_over_bound = 0
    lora_loaded = False
    start = time.perf_counter()

    def sample(i: int) -> None:
        gc.collect()
        samples.append({"request": i, "memory": memory(), "cache_bytes": pipe._encodings.nbytes,
                        "cache_entries": len(pipe._encodings), "seconds": round(time.perf_counter() - start, 2)})
        if log:
            log(json.dumps(samples[-1]))

    first = {"frames": frames[0]} if frames else {}

    def fields() -> dict[str, Any]:
        size = rng.choice(sizes)
        return {"height": size, "width": size, "steps": rng.choice(steps),
                "max_sequence_length": rng.choice(sequence_lengths)} | ({"frames": rng.choice(frames)} if frames else {})

    for i in range(count):
        if i % every == 0:
            sample(i)
        # the reference first, then one of each kind, then a weighted draw
        kind = ["repeat", *kinds][i] if i <= len(kinds) else rng.choices(kinds, weights)[0]
        counts[kind] += 1
        began = time.perf_counter()
        if kind in ("generate", "unique"):
            batch = rng.choice(batch_sizes)
            prompts = [rng.choice(pool) for _ in range(batch)] if kind == "generate" else [
                f"{rng.choice(pool)} {i} {k}" for k in range(batch)]
            scale = rng.choice([None, *guidance_scales])
            extra = {} if scale is None else {"guidance_scale": scale}
            out = pipe(prompts, seed=rng.randrange(2**32), **fields(), **extra)
            assert out.array.shape[0] == batch and np.isfinite(out.array).all()
        elif kind == "refused":
            bad = rng.choice([{"height": sizes[0] + 1}, {"guidance_scale": float("nan")}, {"steps": 0},
                              {"seed": 2**64}, {"max_sequence_length": 0}, {"prompt": 7}])
            args = {"prompt": "one", "seed": 0} | bad
            try:
                pipe(args.pop("prompt"), **args)
            except SpecError:
                pass
            else:
                raise AssertionError(f"request {bad} was not refused")
        elif kind == "rollout":
            if rollout_sampler is None:
                continue
            prompts = [rng.choice(pool) for _ in range(rng.choice(batch_sizes))]
            request = fields() | {"height": sizes[0], "width": sizes[0]} | first  # the smallest: replays keep graphs
            request["steps"] = max(request["steps"], 2)
            ro = pipe.rollout(prompts, group_size=2, seed=rng.randrange(2**32), sampler=rollout_sampler, **request)
            grad = rng.random() < 0.5
            replay = pipe.log_prob(ro, grad=grad, micro_batch=1 if grad else None)
            if grad and replay.log_probs.requires_grad:
                replay.log_probs.sum().backward()
                for p in denoiser.parameters():
                    p.grad = None
            assert torch.isfinite(replay.log_probs).all()
        elif kind == "lora":
            action = rng.choice(["set", "set", "scale", "update"])
            if action == "set" or not lora_loaded:
                set_lora(pipe, "policy", loras[rng.randrange(len(loras))], scale=rng.choice(lora_scales))
                lora_loaded = True
            elif action == "scale":
                scale_lora(pipe, "policy", rng.choice(lora_scales))
            else:
                update_weights(pipe, [(name, param.detach().clone())])  # same values: a sync that changes nothing
        else:
            with reference(pipe):
                out = pipe(pool[0], seed=1234, height=sizes[0], width=sizes[0], steps=steps[0], **first)
            if reference_array is None:
                reference_array = out.array
            elif not np.array_equal(out.array, reference_array):
                raise AssertionError(f"request {i}: the repeated reference request returned a different array "
                                     f"(max difference {np.abs(out.array - reference_array).max():.3g})")
        if pipe._encodings.nbytes > pipe._encodings.max_bytes:
            cache_over_bound += 1
        seconds[kind] += time.perf_counter() - began
    sample(count)
    return {"requests": count, "kinds": counts, "seconds_by_kind": {k: round(v, 2) for k, v in seconds.items()},
            "samples": samples, "seconds": round(time.perf_counter() - start, 1),
            "cache_bound_bytes": pipe._encodings.max_bytes, "cache_over_bound": cache_over_bound,
            "repeats_identical": counts["repeat"]}


def digits_soak(count: int = 1000, cache_bytes: int = 16 * 1024, every: int = 50, log=None) -> dict[str, Any]:
    """The CPU soak: the digits model (one size, 32x32), a step-mask cache policy, an encoding cache of
    ``cache_bytes`` (room for a few dozen encodings, so eviction runs), rank-2 LoRAs; one torch thread (the model
    is tiny: one thread is as fast as two, and far faster when the cores are shared)."""
    import omnispec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = omnispec.build(harness.ROOT / "specs" / "digits.yaml", overrides=[
            "runtime.progress=false", f"runtime.encoding_cache_bytes={cache_bytes}",
            "policies.cache={kind: step_mask, mask: [true, true, false, true]}"])
        loras = [random_lora(pipe.components["transformer"], ("to_q", "to_v"), 2, seed) for seed in range(3)]
        return soak(pipe, count, sizes=[32], steps=[2, 1, 3, 4], batch_sizes=[1, 2, 3, 4],
                    guidance_scales=[1.0, 2.0, 4.5], sequence_lengths=[8, 4, 6], loras=loras,
                    rollout_sampler={"kind": "sde", "noise_level": 0.7,
                                     "window": {"kind": "fixed", "start": 0, "length": 1}},
                    memory=process_memory, every=every, seed=0, log=log)
    finally:
        torch.set_num_threads(threads)


# What each model soaks: its spec, its components (random weights at real sizes), the LoRA targets, and the request
# mix's defaults (sizes, frames, sequence lengths); --smoke shrinks the sizes.
MODELS = {
    "flux": {"spec": "flux1-dev.yaml", "components": "flux_components", "lora": ("to_q", "to_k", "to_v"),
             "sizes": "512,768,1024", "frames": "", "sequence_lengths": (128, 256, 512), "smoke_sizes": "64,32",
             "sampler": {}},
    # UniPC is a multistep solver: rollouts take Euler and SDE steps on its sigmas, as Flow-GRPO's Wan pipeline does
    "wan_ti2v": {"spec": "wan2.2-ti2v-5b.yaml", "components": "wan_ti2v_components", "lora": ("to_q", "to_k", "to_v"),
                 "sizes": "256,384", "frames": "9,17", "sequence_lengths": (128, 256, 512), "smoke_sizes": "64,32",
                 "sampler": {"multistep": "euler"}},
}


def model_pipeline(model: str, cache_bytes: int | None, overrides: Sequence[str] = ()):
    """``model``'s bundled spec over its components at real sizes, on the benchmark device."""
    import omnispec

    sets = ["runtime.progress=false", *overrides]
    if cache_bytes is not None:
        sets.append(f"runtime.encoding_cache_bytes={cache_bytes}")
    components = getattr(workloads, MODELS[model]["components"])()
    return omnispec.build(harness.ROOT / "specs" / MODELS[model]["spec"], components=components,
                          device=harness.DEVICE, overrides=sets)


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="flux")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--steps", default="4,2", help="step counts to draw from (the first is the reference's)")
    parser.add_argument("--sizes", help="square sizes to draw from (the first: the reference's and the rollouts'; "
                                         "default: the model's)")
    parser.add_argument("--frames", help="a video model's frame counts to draw from (default: the model's)")
    parser.add_argument("--batch-sizes", default="1,2")
    parser.add_argument("--every", type=int, default=10, help="sample memory every N requests")
    parser.add_argument("--cache-bytes", type=int, help="runtime.encoding_cache_bytes (default: the spec's default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="OVERRIDE",
                        help="a spec override for the soaked pipeline (e.g. policies.compile.mode=regional)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", action="store_true", help="the CPU soak of tests/test_soak.py")


def benchmark(args, results: harness.Results) -> None:
    """The soak's result is one document (its memory samples printed as they come), written to ``--json``."""
    if args.digits:
        result = digits_soak(args.requests, every=args.every, log=print)
        harness.show({k: v for k, v in result.items() if k != "samples"})
        results.header |= result
        results.write()
        return

    model = MODELS[args.model]
    args.sizes = args.sizes or model["sizes"]
    args.frames = model["frames"] if args.frames is None else args.frames
    if args.smoke:
        args.sizes, args.steps, args.requests, args.every = model["smoke_sizes"], "2,1", min(args.requests, 8), min(
            args.every, 4)
        args.frames = "5,9" if args.frames else ""
    elif not torch.cuda.is_available():  # --digits runs on the CPU by design, the other soaks on CUDA
        raise SystemExit("needs CUDA (or --smoke)")

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    pipe = model_pipeline(args.model, args.cache_bytes, args.overrides)
    transformer = pipe.components["transformer"].requires_grad_(False)  # a replay's gradients reach LoRA weights only
    loras = [random_lora(transformer, model["lora"], 4 if args.smoke else 16, s) for s in range(3)]
    memory = process_memory if harness.DEVICE == "cpu" else cuda_memory
    if harness.DEVICE != "cpu":
        torch.cuda.reset_peak_memory_stats()
    result = soak(pipe, args.requests, sizes=ints(args.sizes), steps=ints(args.steps), frames=ints(args.frames),
                  batch_sizes=ints(args.batch_sizes), guidance_scales=(2.0, 3.5, 5.0),
                  sequence_lengths=(8, 16) if args.smoke else model["sequence_lengths"],
                  loras=loras, rollout_sampler={"kind": "sde", "noise_level": 0.7, **model["sampler"],
                                                "window": {"kind": "fixed", "start": 0, "length": 1}},
                  memory=memory, every=args.every, seed=args.seed, log=print)
    result |= {"device": harness.device_name(), "args": vars(args) | {"json": str(args.json) if args.json else None},
               "attention": pipe.explain(as_dict=True).get("attention_with_gradients")}
    if harness.DEVICE != "cpu":
        mem = [s["memory"] for s in result["samples"]]
        warm = mem[len(mem) // 4:]
        result["summary"] = {
            "peak_gib": max(m["peak"] for m in mem) / 2**30,
            "steady_allocated_gib_after_warmup": [min(m["allocated"] for m in warm) / 2**30,
                                                  max(m["allocated"] for m in warm) / 2**30],
            "reserved_gib_end": mem[-1]["reserved"] / 2**30,
        }
        harness.show(result["summary"])
    results.header |= result
    results.write()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, layout="document")


if __name__ == "__main__":
    main()
