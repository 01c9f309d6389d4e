"""Timing and reporting shared by the single-kernel benchmarks (``gpu_norm_rope``, ``gpu_gemm_epilogue``,
``gpu_attention_kernels``, ``gpu_gemm_kernels``). Imports torch only, so a kernel benchmark runs where diffusers and
omnispec are not installed (a device call that carries a kernel's own packages has no room left for theirs)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def microseconds(fn: Callable, inputs: tuple, iters: int, device: str) -> list[float]:
    """Device time per call: on CUDA the call is recorded once as a CUDA graph and replayed, so the host's launch
    cost (a Triton kernel's Python launcher takes tens of microseconds) is not timed, as in a step under CUDA
    graphs."""
    rounds = []
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*inputs)
    for _ in range(5):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                fn(*inputs)
            rounds.append((time.perf_counter() - begin) * 1e6 / iters)
    return rounds


class ClockSampler:
    """nvidia-smi reading the SM clock and board power every 100 ms while a row's rounds run (absent tool: none)."""

    def __init__(self, enabled: bool):
        self.tool = shutil.which("nvidia-smi") if enabled else None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ClockSampler:
        if self.tool:
            self.process = subprocess.Popen(
                [self.tool, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.process:
            self.process.terminate()
            out = self.process.communicate(timeout=10)[0]
            samples = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
            try:
                self.clock_mhz = statistics.median(float(s[0]) for s in samples)
                self.power_w = statistics.median(float(s[1]) for s in samples)
            except (ValueError, statistics.StatisticsError):
                pass

    def fields(self) -> dict:
        return {k: getattr(self, k) for k in ("clock_mhz", "power_w") if hasattr(self, k)}


def labelled_variants(shape: str, names: list[str], make: Callable[[str], Callable]) -> tuple[dict, list[dict]]:
    """``make(name)`` for each name, labelled ``name #2`` and on where a name comes again (under a power cap the clock
    drifts as a run goes on, so a kernel is timed again between others); one ``make`` cannot give (an absent
    package) is an error row."""
    variants, errors = {}, []
    for i, name in enumerate(names):
        times = names[:i].count(name)
        label = f"{name} #{times + 1}" if times else name
        try:
            variants[label] = make(name)
        except Exception as exc:  # noqa: BLE001 - that row's error
            errors.append({"shape": shape, "config": label, "error": f"{type(exc).__name__}: {exc}"})
    return variants, errors


def kernel_row(shape: str, name: str, fn: Callable, inputs: tuple, reference: torch.Tensor, flops: float, *,
               iters: int | None = None, seconds: float | None = None, clocks: bool = False) -> dict:
    """One kernel's row: its first call's seconds (a JIT kernel compiles there), then five timed rounds of ``iters``
    calls, or of as many as take ``seconds`` (under a power cap, long enough for the clock to settle), with the SM
    clock and power meanwhile when ``clocks``; its rate for ``flops`` a call and its output's relative L2 distance
    from ``reference``. Printed as a JSON line as it comes."""
    device = inputs[0].device.type
    with torch.no_grad():
        begin = time.perf_counter()
        out = fn(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        first_s = time.perf_counter() - begin
        for _ in range(2):  # the allocator, lazily built state
            out = fn(*inputs)
        if iters is None:
            one = statistics.median(microseconds(fn, inputs, 3, device))
            iters = max(2, math.ceil((seconds or 1.0) * 1e6 / one))
        with ClockSampler(clocks and device == "cuda") as sampler:
            rounds = microseconds(fn, inputs, iters, device)
    ms = statistics.median(rounds) / 1e3
    got, want = out.float(), reference.float()
    row = {"shape": shape, "config": name, "ms_per_call": ms, "rounds_us": rounds, "iters": iters,
           "tflops": flops / ms / 1e9, "first_call_s": first_s,
           "rel_l2_vs_fp32": float((got - want).norm() / want.norm()), **sampler.fields()}
    print(json.dumps(row), flush=True)
    return row


# The columns a kernel row prints: its time, rate, the clock and power it ran at, its first call and its error.
KERNEL_COLUMNS: dict[str, Callable[[dict], object]] = {
    "ms per call": lambda r: f"{r['ms_per_call']:.3f}", "TFLOP/s": lambda r: f"{r['tflops']:.0f}",
    "SM MHz": lambda r: r.get("clock_mhz", ""), "W": lambda r: r.get("power_w", ""),
    "first call s": lambda r: f"{r['first_call_s']:.1f}", "rel L2 vs fp32": lambda r: f"{r['rel_l2_vs_fp32']:.2e}"}


# The columns a memory-bound kernel's row prints (``gpu_norm_rope``, ``gpu_adaln_norm``): its time, the rate at which
# it moves the bytes it must, and how far its output is from eager's.
BANDWIDTH_COLUMNS: dict[str, Callable[[dict], object]] = {
    "us per call": lambda r: f"{r['us_per_call']:.1f}", "TB/s": lambda r: f"{r['tb_per_s']:.2f}",
    "max abs vs eager": lambda r: r.get("max_abs_vs_eager", ""),
    "share differing": lambda r: r.get("share_differing_vs_eager", "")}


def measure_each(shape: str, variants: dict[str, Callable], measure_one: Callable[[str, Callable], dict]) -> list[dict]:
    """``measure_one(name, fn)``'s row for each variant; one that fails gives an error row and the others still run."""
    rows = []
    for name, fn in variants.items():
        try:
            rows.append(measure_one(name, fn))
        except Exception as exc:  # noqa: BLE001 - keep the other variants' rows
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            rows.append({"shape": shape, "config": name, "error": f"{type(exc).__name__}: {first_line}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict], path: Path | None, columns: dict[str, Callable[[dict], object]]) -> None:
    """Write ``rows`` to ``path`` (JSON) when given, and print them as a table: shape, config, then ``columns``."""
    if path:
        path.write_text(json.dumps({"rows": rows}, indent=1))
    print("| shape | config | " + " | ".join(columns) + " |")
    for r in rows:
        cells = [f"error: {r['error'][:80]}", *[""] * (len(columns) - 1)] if "error" in r else [
            str(cell(r)) for cell in columns.values()]
        print(f"| {r['shape']} | {r['config']} | " + " | ".join(cells) + " |")
