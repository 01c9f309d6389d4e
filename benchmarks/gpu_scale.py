"""Scale-out policies on two GPUs: per-rank peak memory, weight bytes and per-step time; VAE decode peak, tiled.
No peer: the reference is omnispec on one GPU in the same call (tensor 2, shard 2, shard 2 with distributed layerwise
offload, cfg 2 with vae_patch 2 against it), and the untiled VAE decode for the tiled one.

``torchrun --nproc-per-node 2 -m benchmarks.gpu_scale [--workloads wan,ltx2] [--json FILE]``  (two GPUs of one host,
``NCCL_NVLS_ENABLE=0``); ``python -m benchmarks.gpu_scale --parts vae`` runs the one-GPU VAE rows alone.
``--smoke``: tiny models on CPU ranks over gloo, to check the script (its numbers mean nothing).

Wan 14B at 480x832x81 and LTX-2 19B at 512x768x121 (random bf16 weights at the real configs, the same seed on every
rank, built by ``workloads``). The single-GPU row runs on rank 0 while the others wait. A
configuration omnispec refuses for a family (a family without a tensor plan, a VAE decoder that draws noise under
vae_patch) is a row with the refusal, not an error. VAE rows: Wan's VAE at 720x1280x121 (its default tiles) and
FLUX's at 1024x1024 (512 px tiles, 64 px overlap), decode peak with tiling off and on, switched on as
``policies.vae.tiling`` does.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import harness, workloads
from .workloads import LTX2_SIZE, SMOKE_WAN_VAE, ltx2_components

CONFIGS = {
    "single": [],
    "tensor2": ["policies.parallel.tensor=2"],
    "shard2": ["policies.parallel.shard=2"],
    "shard2+offload": ["policies.parallel.shard=2", "policies.offload={strategy: layerwise, distributed: true}"],
    "cfg2+vae_patch2": ["policies.parallel.cfg=2", "policies.parallel.vae_patch=2", "policies.vae.tiling=true"],
    # compiled blocks (not in the default list): eager, every operation on a split weight is a DTensor dispatch on
    # the host, which compiled blocks do not pay
    "single+compile": ["policies.compile.mode=regional"],
    "tensor2+compile": ["policies.parallel.tensor=2", "policies.compile.mode=regional"],
}
DEFAULT_CONFIGS = ("single", "tensor2", "shard2", "shard2+offload", "cfg2+vae_patch2")
WORKLOADS = {
    "wan": dict(spec="wan2.1-t2v-1.3b.yaml", components=lambda: workloads.WORKLOADS["wan"]["components"](),
                request=lambda: dict(workloads.WORKLOADS["wan"]["request"]), steps=(1, 2)),
    "ltx2": dict(spec="ltx2-t2v.yaml", components=lambda: _without(ltx2_components(), "latent_upsampler"),
                 request=lambda: dict(LTX2_SIZE), steps=(1, 2)),
}


def _without(mods: dict, *names: str) -> dict:
    return {k: v for k, v in mods.items() if k not in names}  # the one-stage spec names no upsampler


def _local_bytes(module: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    tensors = (t.to_local() if isinstance(t, DTensor) else t for t in (*module.parameters(), *module.buffers()))
    return sum(t.numel() * t.element_size() for t in tensors)


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if harness.DEVICE == "cuda" else 0.0


def _allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if harness.DEVICE == "cuda" else 0.0


def _reset_peak() -> None:
    if harness.DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(name: str, label: str, repeats: int) -> dict | None:
    import omnispec
    from omnispec.spec import SpecError
    from omnispec.spec.request import resolve_request

    rank, world = dist.get_rank(), dist.get_world_size()
    single = not any("parallel" in setting for setting in CONFIGS[label])
    if single and rank != 0:
        dist.barrier()
        return None
    w = WORKLOADS[name]
    torch.manual_seed(0)  # identical random weights on every rank
    mods = w["components"]()
    overrides = ["runtime.progress=false", "policies.attention.default=sdpa", *CONFIGS[label]]
    row: dict = {"workload": name, "config": label, "ranks": 1 if single else world}
    try:
        pipe = omnispec.build(harness.ROOT / "specs" / w["spec"], components=mods, device=harness.DEVICE,
                              overrides=overrides)
    except SpecError as exc:  # this family cannot take this policy: a row that says why
        if "policies." not in str(exc):
            raise
        row["refused"] = str(exc)
        if single:
            dist.barrier()
        return row
    request = w["request"]()
    lo, hi = workloads.WORKLOADS["wan"]["steps"] if harness.SMOKE else w["steps"]

    def run(n):
        return pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **request),
                             decode=label.endswith("vae_patch2"))

    _reset_peak()
    before = _allocated_gib()  # the built pipeline, and whatever an earlier row failed to free
    with torch.no_grad():
        run(lo)
        med, samples = harness.per_step(run, lo, hi, repeats)
    # no name may keep a denoiser past here: a sharded one is freed only by the collection below (FSDP's hooks and
    # prefetch lists hold it in cycles), and one still named then stays on the device into the next row
    denoiser_bytes = sum(_local_bytes(pipe.components[n]) for n, c in pipe.spec.model.components.items()
                         if c.role == "denoiser")
    row |= {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "peak_gib": _peak_gib(),
            "allocated_before_gib": before, "denoiser_gib_per_rank": denoiser_bytes / 2**30}
    pipe = mods = None
    harness.free_device_memory()
    if single:
        dist.barrier()
    return row


def vae_rows():
    """One GPU: decode peak with tiling off and on (Wan's VAE at 720p x 121 frames, FLUX's at 1024x1024)."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    from omnispec.policies.vae import enable_tiling
    from omnispec.spec.policies import VaeTiles

    # (make, latent shape, tiles): Wan's VAE at its default tiles (256 px, stride 192); FLUX's (sample_size 1024,
    # which would not tile a 1024x1024 image) at 512 px tiles overlapping 64 px, as policies.vae.tiling sets them.
    flux = dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), sample_size=1024,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2)
    cases = {"wan 720x1280x121": (AutoencoderKLWan, (1, 16, 31, 90, 160), True),
             "flux 1024x1024": (lambda: AutoencoderKL(**flux), (1, 16, 128, 128), VaeTiles(tile=512, overlap=64))}
    if harness.SMOKE:
        cases = {"wan (smoke)": (lambda: AutoencoderKLWan(**SMOKE_WAN_VAE), (1, 16, 2, 8, 8), True)}  # tiny VAE
    for label, (make, shape, tiles) in cases.items():
        torch.manual_seed(0)
        vae = make().to(harness.DEVICE, torch.bfloat16 if harness.DEVICE == "cuda" else torch.float32).eval()
        z = torch.randn(shape, device=harness.DEVICE, dtype=next(vae.parameters()).dtype)
        for tiled in (False, True):
            described = enable_tiling(vae, tiles, "vae") if tiled else "untiled"
            _reset_peak()
            row = {"workload": label, "config": f"vae {described}", "ranks": 1}
            try:
                with torch.no_grad():
                    vae.decode(z)
                row["peak_gib"] = _peak_gib()
            except torch.OutOfMemoryError:
                row["out_of_memory"] = True
            yield row
            harness.free_device_memory()
        vae = None


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="wan,ltx2")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--parts", default="ranks,vae")
    parser.add_argument("--repeats", type=int, default=2)


def benchmark(args, results: harness.Results) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.smoke:
        LTX2_SIZE.update(height=64, width=64, frames=9, fps=24)
    parts = args.parts.split(",")
    if "ranks" in parts:
        if not dist.is_initialized():
            dist.init_process_group("gloo" if args.smoke else "nccl")
        if not args.smoke:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        for name in args.workloads.split(","):
            for label in args.configs.split(","):
                try:
                    row = measure(name, label, args.repeats)
                except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                    row = {"workload": name, "config": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
                if row and dist.get_rank() == 0:
                    results.save(row)
    if "vae" in parts and (not dist.is_initialized() or dist.get_rank() == 0):
        for row in vae_rows():
            results.save(row)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, layout="list",
                          smoke="tiny models on CPU ranks over gloo (checks the script only; its numbers mean nothing)")


if __name__ == "__main__":
    main()
