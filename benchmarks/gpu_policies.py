"""Policies at real sizes (random bf16 weights): per-step time, peak memory and MFU as ratios to the plain
eager run measured in the same call, with diffusers' own calls as peers where they exist.

``python -m benchmarks.gpu_policies [--parts attention,compile,model_offload,layerwise] [--json FILE]``

- attention (FLUX.1-dev 1024²): every usable backend, omnispec ``auto``, and diffusers' ``set_attention_backend``.
- compile (FLUX.1-dev 1024²): omnispec ``compile: regional``; compile time reported separately.
- model_offload (FLUX.1-dev 1024²): peak memory and time of ``offload: model``.
- layerwise (Wan 14B 480x832x81, CFG): ``offload: layerwise`` vs resident, and diffusers' ``apply_group_offloading``.
Per-step time = (time of N_hi steps - N_lo steps) / (N_hi - N_lo), latents not decoded.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from . import gpu_interpreter as gi

ROOT = Path(__file__).resolve().parents[1]


def _build(spec: str, mods: dict, overrides: list[str]):
    import omnispec

    return omnispec.build(ROOT / "specs" / spec, components=mods, device=gi.DEVICE,
                          overrides=["runtime.progress=false", *overrides])


def _runner(pipe, request: dict):
    from omnispec.spec.request import resolve_request

    def run(n: int):
        pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **request), decode=False)

    return run


def _peak(run, n: int) -> float:
    if gi.DEVICE != "cuda":
        return 0.0
    gi._sync()
    torch.cuda.reset_peak_memory_stats()
    run(n)
    gi._sync()
    return torch.cuda.max_memory_allocated() / 2**30


def _release(mods: dict, names: tuple[str, ...] | None = None) -> None:
    """Move modules (all, or ``names``) back to the host and free the device cache for the next build."""
    for name, m in mods.items():
        if isinstance(m, torch.nn.Module) and (names is None or name in names):
            m.to("cpu")
    gc.collect()
    if gi.DEVICE == "cuda":
        torch.cuda.empty_cache()


def _measure(run, lo, hi, repeats, flops, ceiling) -> dict:
    with torch.no_grad():
        run(lo)  # warm-up (and lazy compilation)
        med, samples = gi.per_step(run, lo, hi, repeats)
    return {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "mfu": flops / med / ceiling,
            "peak_gib": _peak(run, lo)}


def attention_part(repeats: int, ceiling: float) -> list[dict]:
    mods = gi.flux_components()
    w = gi.WORKLOADS["flux"]
    rows = []
    plain = _build(w["spec"], mods, ["policies.attention.default=sdpa"])
    flops = gi.flops_per_step(_runner(plain, w["request"]))
    for backend in ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sage", "auto"):
        try:
            pipe = _build(w["spec"], mods, [f"policies.attention.default={backend}"])
        except Exception as exc:  # noqa: BLE001 - an unusable backend is a result, not a crash
            rows.append({"part": "attention", "config": backend, "error": str(exc).splitlines()[0]})
            continue
        row = {"part": "attention", "config": backend, **_measure(_runner(pipe, w["request"]), 2, 4, repeats, flops, ceiling)}
        if backend == "auto":
            row["explain"] = pipe.explain()["attention"]
            from omnispec.policies.attention import AUTO_CHOICES

            row["auto_choices"] = {str(k): v for k, v in AUTO_CHOICES.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # peer: diffusers' dispatcher on the same modules
    import diffusers

    ref = diffusers.FluxPipeline(**mods)
    ref.set_progress_bar_config(disable=True)
    for name in ("native", "_native_flash", "_native_cudnn"):
        try:
            ref.transformer.set_attention_backend(name)
        except Exception as exc:  # noqa: BLE001
            rows.append({"part": "attention", "config": f"diffusers {name}", "error": str(exc).splitlines()[0]})
            continue

        def run(n):
            ref("a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent", **w["diffusers_kwargs"])

        try:
            rows.append({"part": "attention", "config": f"diffusers {name}", **_measure(run, 2, 4, repeats, flops, ceiling)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"part": "attention", "config": f"diffusers {name}", "error": str(exc).splitlines()[0]})
        finally:
            ref.transformer.reset_attention_backend()  # diffusers also sets a process-wide active backend
            from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

            _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def compile_part(repeats: int, ceiling: float) -> list[dict]:
    mods = gi.flux_components()
    w = gi.WORKLOADS["flux"]
    plain = _build(w["spec"], mods, [])
    run_plain = _runner(plain, w["request"])
    flops = gi.flops_per_step(run_plain)
    rows = [{"part": "compile", "config": "eager", **_measure(run_plain, 2, 4, repeats, flops, ceiling)}]
    print(json.dumps(rows[-1]), flush=True)
    pipe = _build(w["spec"], mods, ["policies.compile.mode=regional"])
    run = _runner(pipe, w["request"])
    start = time.perf_counter()
    with torch.no_grad():
        run(1)
    gi._sync()
    compile_s = time.perf_counter() - start
    rows.append({"part": "compile", "config": "regional", "first_call_s": compile_s,
                 **_measure(run, 2, 4, repeats, flops, ceiling)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def model_offload_part(repeats: int, ceiling: float) -> list[dict]:
    mods = gi.flux_components()
    w = gi.WORKLOADS["flux"]
    plain = _build(w["spec"], mods, [])
    run_plain = _runner(plain, w["request"])
    flops = gi.flops_per_step(run_plain)
    rows = [{"part": "model_offload", "config": "resident", **_measure(run_plain, 2, 4, repeats, flops, ceiling)}]
    _release(mods)
    pipe = _build(w["spec"], mods, ["policies.offload.strategy=model"])
    run = _runner(pipe, w["request"])
    rows.append({"part": "model_offload", "config": "model", **_measure(run, 2, 4, repeats, flops, ceiling)})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def layerwise_part(repeats: int, ceiling: float) -> list[dict]:
    mods = gi.wan_components()
    w = gi.WORKLOADS["wan"]
    resident = _build(w["spec"], mods, [])
    run_res = _runner(resident, w["request"])
    flops = gi.flops_per_step(run_res)
    rows = [{"part": "layerwise", "config": "resident", **_measure(run_res, 1, 2, repeats, flops, ceiling)}]
    print(json.dumps(rows[-1]), flush=True)
    _release(mods, ("transformer",))
    pipe = _build(w["spec"], mods, ["policies.offload.strategy=layerwise"])
    rows.append({"part": "layerwise", "config": "layerwise", **_measure(_runner(pipe, w["request"]), 1, 2, repeats,
                                                                        flops, ceiling)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


PARTS = {"attention": attention_part, "compile": compile_part, "model_offload": model_offload_part,
         "layerwise": layerwise_part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="attention,compile,model_offload,layerwise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script only)")
    args = parser.parse_args()
    if args.smoke:
        gi.enable_smoke()
        ceiling = 1e12
    else:
        ceiling = gi.matmul_ceiling()
    rows = []
    for part in args.parts.split(","):
        try:
            rows += PARTS[part](args.repeats, ceiling)
        except Exception as exc:  # noqa: BLE001 - keep the other parts' results
            rows.append({"part": part, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        if gi.DEVICE == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps({"ceiling_tflops": ceiling / 1e12, "rows": rows}, indent=1))
    print("| part | config | ms/step | MFU | peak GiB |")
    for r in rows:
        if "error" in r:
            print(f"| {r['part']} | {r.get('config', '')} | error: {r['error'][:80]} | | |")
        else:
            print(f"| {r['part']} | {r['config']} | {r['ms_per_step']:.1f} | {r['mfu']:.0%} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
