"""Interpreter overhead on the CPU: omnispec vs the diffusers pipeline, same tiny checkpoint and settings.

``python -m benchmarks.cpu_overhead [--repeats 9] [--steps 10]``

The tiny checkpoints make the models nearly free, so any cost omnispec adds (plan compilation, pass
batching, hooks) shows up in the ratio. Calls alternate between the two so that drift hits both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def cases(tmp: Path, steps: int):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline, WanPipeline

    from omnispec.testing import TINY_OVERRIDES, tiny_flux, tiny_sd3, tiny_wan

    gen = lambda s: torch.Generator("cpu").manual_seed(s)  # noqa: E731
    flux = tiny_flux(tmp / "flux")
    yield ("flux (embedded guidance)", "flux1-dev.yaml", flux, TINY_OVERRIDES["flux"], {"steps": steps},
           lambda p: p("a cat", height=32, width=32, num_inference_steps=steps, guidance_scale=3.5,
                       max_sequence_length=16, generator=gen(0), output_type="np"), FluxPipeline)
    sd3 = tiny_sd3(tmp / "sd3")
    yield ("sd3 (cfg)", "sd3.5-medium.yaml", sd3, TINY_OVERRIDES["sd3"], {"steps": steps},
           lambda p: p("a cat", height=32, width=32, num_inference_steps=steps, guidance_scale=4.5,
                       max_sequence_length=16, generator=gen(0), output_type="np"), StableDiffusion3Pipeline)
    wan = tiny_wan(tmp / "wan")
    yield ("wan2.1 (cfg, unipc)", "wan2.1-t2v-1.3b.yaml", wan, TINY_OVERRIDES["wan"], {"steps": steps},
           lambda p: p("a cat", height=32, width=32, num_frames=5, num_inference_steps=steps, guidance_scale=5.0,
                       max_sequence_length=16, generator=gen(0), output_type="np"), WanPipeline)


def main() -> None:
    import omnispec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}, steps {args.steps}")
    print("| workload | diffusers median s | omnispec median s | ratio omnispec/diffusers |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec, ckpt, overrides, request, call_ref, cls in cases(Path(tmp), args.steps):
            ours = omnispec.build(ROOT / "specs" / spec, source=str(ckpt), overrides=overrides)
            ref = cls.from_pretrained(str(ckpt), dtype=torch.float32)
            ref.set_progress_bar_config(disable=True)
            call_ours = lambda: ours("a cat", seed=0, **request)  # noqa: E731
            call_ours(), call_ref(ref)  # warm-up
            t_ours, t_ref = [], []
            for _ in range(args.repeats):
                t_ref += _time(lambda: call_ref(ref), 1)
                t_ours += _time(call_ours, 1)
            m_ref, m_ours = statistics.median(t_ref), statistics.median(t_ours)
            print(f"| {name} | {m_ref:.4f} | {m_ours:.4f} | {m_ours / m_ref:.3f} |", flush=True)


if __name__ == "__main__":
    main()
