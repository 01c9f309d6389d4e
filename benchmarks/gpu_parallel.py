"""Parallel policies on two GPUs: per-step time of cfg=2, ulysses=2 and ring=2 against one GPU, and the outputs' match.
Peer: omnispec on one GPU in the same call, and diffusers' own context parallelism (ulysses 2, ring 2).

``torchrun --nproc-per-node 2 -m benchmarks.gpu_parallel [--workloads flux,wan] [--json FILE]``
(``--smoke``: tiny models on CPU with gloo, to check the script.)

FLUX.1-dev-size at 1024² with true CFG (two passes) and Wan 14B-size at 480x832x81 with CFG, random bf16
weights made from the same seed on every rank. For each configuration fresh modules are built (context
parallelism attaches to a module once); the single-GPU runs go on rank 0 while rank 1 waits. The peers are
diffusers' own context-parallel call (``enable_parallelism(ContextParallelConfig(ulysses_degree=2 | ring_degree=2))``)
on the diffusers pipeline. Outputs (latents, same seed) are compared with the single-GPU run: max abs
difference and cosine. ``single-unbatched`` is the single-GPU run with one sample row per forward (as each
cfg rank runs): its difference is what bf16 alone moves with the batch shape, the floor for the others.
Keep NVLink multicast off (the device README): NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import harness
from .workloads import PARALLEL_DEGREES, WORKLOADS, parallel_overrides

# Per-step time = (time of hi steps - time of lo steps) / (hi - lo); Wan's 6.4 s steps keep its count low.
STEPS = {"flux": (2, 6), "wan": (1, 2)}


def _components(name: str) -> dict:
    torch.manual_seed(0)  # identical random weights on every rank
    if harness.DEVICE == "cuda":
        torch.cuda.manual_seed_all(0)
    return WORKLOADS[name]["components"]()


def _steps(name: str) -> tuple[int, int]:
    return WORKLOADS[name]["steps"] if harness.SMOKE else STEPS[name]


def _timed_row(run, name: str, label: str, repeats: int) -> dict:
    """Per-step time of ``run(n)`` after a warm-up run, as a result row."""
    lo, hi = _steps(name)
    with torch.no_grad():
        run(lo)
        med, samples = harness.per_step(run, lo, hi, repeats)
    return {"workload": name, "config": label, "ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples]}


def measure(name: str, label: str, repeats: int) -> dict | None:
    import omnispec
    from omnispec.spec.request import resolve_request

    degrees = PARALLEL_DEGREES[label]
    rank = dist.get_rank()
    if not degrees and rank != 0:
        dist.barrier()
        return None
    w = WORKLOADS[name]
    mods = _components(name)
    pipe = omnispec.build(harness.ROOT / "specs" / w["spec"], components=mods, device=harness.DEVICE,
                          overrides=parallel_overrides(name, label))
    request = w["request"] | ({"negative_prompt": "blurry"} if name == "flux" else {})

    def run(n):
        return pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **request), decode=False)

    row = _timed_row(run, name, label, repeats)
    with torch.no_grad():
        streams = run(_steps(name)[0]).latents  # every latent stream, flattened into one vector
        latents = torch.cat([v.float().flatten().cpu() for v in streams.values()])
    if label == "single":
        torch.save(latents, f"/tmp/omnispec_parallel_{name}_single.pt")
    if not degrees:
        dist.barrier()
    if label != "single" and rank == 0:
        ref = torch.load(f"/tmp/omnispec_parallel_{name}_single.pt")
        row |= {"max_abs_diff": (latents - ref).abs().max().item(),
                "cosine": torch.nn.functional.cosine_similarity(latents.flatten(), ref.flatten(), dim=0).item()}
    pipe = mods = None  # free memory before the next configuration
    harness.free_device_memory()
    return row


def diffusers_peer(name: str, degrees: dict, repeats: int) -> dict:
    """The same degree through diffusers' own call: ``enable_parallelism(ContextParallelConfig(...))``."""
    import diffusers
    from diffusers import ContextParallelConfig

    w = WORKLOADS[name]
    mods = _components(name)
    if degrees.get("ring_degree", 1) > 1:
        mods["transformer"].set_attention_backend("_native_flash")  # diffusers' ring needs the log-sum-exp
    mods["transformer"].enable_parallelism(config=ContextParallelConfig(**degrees))
    ref = getattr(diffusers, w["pipeline"])(**mods)
    ref.set_progress_bar_config(disable=True)
    kwargs = dict(w["diffusers_kwargs"])
    if name == "flux":
        kwargs |= {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}

    def run(n):
        ref("a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent", **kwargs)

    label = "diffusers " + ",".join(f"{k.split('_')[0]}{v}" for k, v in degrees.items())
    row = _timed_row(run, name, label, repeats)
    ref = mods = None
    harness.free_device_memory()
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="flux,wan")
    parser.add_argument("--configs", default="single,single-unbatched,cfg2,ulysses2,ring2")
    parser.add_argument("--repeats", type=int, default=3)


def benchmark(args, results: harness.Results) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    configs = args.configs.split(",")
    dist.init_process_group("gloo" if args.smoke else "nccl")
    if not args.smoke:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    for name in args.workloads.split(","):
        for label in configs:
            try:
                row = measure(name, label, args.repeats)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                row = {"workload": name, "config": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
            if row and dist.get_rank() == 0:
                results.save(row)
        for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}) if not args.smoke else ():
            try:
                row = diffusers_peer(name, degrees, args.repeats)
            except Exception as exc:  # noqa: BLE001
                row = {"workload": name, "config": f"diffusers {degrees}",
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
            if dist.get_rank() == 0:
                results.save(row)
    if dist.get_rank() == 0:
        table(results.rows)
    dist.destroy_process_group()


def table(rows: list[dict]) -> None:
    single = {r["workload"]: r["ms_per_step"] for r in rows if r.get("config") == "single" and "ms_per_step" in r}
    print("| workload | config | ms/step | speed-up vs 1 GPU | max abs diff | cosine |")
    for r in rows:
        if "error" in r:
            print(f"| {r['workload']} | {r['config']} | error: {r['error'][:70]} | | | |")
            continue
        base = single.get(r["workload"])
        speed = f"{base / r['ms_per_step']:.2f}x" if base else ""
        print(f"| {r['workload']} | {r['config']} | {r['ms_per_step']:.1f} | {speed} | "
              f"{r.get('max_abs_diff', '')} | {r.get('cosine', '')} |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, layout="list",
                          smoke="tiny models on CPU ranks over gloo (checks the script only)")


if __name__ == "__main__":
    main()
