"""Interpreter overhead on the CPU: whole requests on tiny checkpoints, where the models are nearly free.
Peer: the diffusers pipeline (eager) on the same tiny checkpoint and settings, calls alternating in the same process.

``python -m benchmarks.cpu_overhead [--repeats 9] [--steps 10]``

The tiny checkpoints make the models nearly free, so any cost omnispec adds (plan compilation, pass
batching, hooks) shows up in the ratio. Calls alternate between the two so that drift hits both.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import harness


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

    def gen(seed: int) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(seed)

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


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)


def benchmark(args, results: harness.Results) -> None:
    import omnispec

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}, steps {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec, ckpt, overrides, request, call_ref, cls in cases(Path(tmp), args.steps):
            ours = omnispec.build(harness.ROOT / "specs" / spec, source=str(ckpt), overrides=overrides)
            ref = cls.from_pretrained(str(ckpt), dtype=torch.float32)
            ref.set_progress_bar_config(disable=True)

            def call_ours(ours=ours, request=request):
                return ours("a cat", seed=0, **request)

            call_ours(), call_ref(ref)  # warm-up
            t_ours, t_ref = [], []
            for _ in range(args.repeats):
                t_ref += _time(lambda call_ref=call_ref, ref=ref: call_ref(ref), 1)
                t_ours += _time(call_ours, 1)
            m_ref, m_ours = statistics.median(t_ref), statistics.median(t_ours)
            results.save({"workload": name, "diffusers_s": m_ref, "omnispec_s": m_ours, "ratio": m_ours / m_ref,
                          "diffusers_samples_s": t_ref, "omnispec_samples_s": t_ours})
    print("| workload | diffusers median s | omnispec median s | ratio omnispec/diffusers |")
    print("|---|---|---|---|")
    for r in results.rows:
        print(f"| {r['workload']} | {r['diffusers_s']:.4f} | {r['omnispec_s']:.4f} | {r['ratio']:.3f} |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke=None)


if __name__ == "__main__":
    main()
