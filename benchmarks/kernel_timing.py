"""What the single-kernel benchmarks share: device time per call, one kernel's row, the tables they print
(``gpu_norm_rope``, ``gpu_adaln_norm``, ``gpu_gemm_epilogue``, ``gpu_attention_kernels``, ``gpu_gemm_kernels``,
``gpu_joint_gemm``), and what a Triton kernel compiles to (``triton_ptx``, ``inductor_kernels``).

A shared module: it imports no benchmark module (``tests/test_benchmark_smoke.py`` checks), and only torch (triton
inside ``compiled_facts``), so a kernel benchmark runs where diffusers and omnispec are not installed (a device call
that carries a kernel's own packages has no room left for theirs)."""

from __future__ import annotations

import collections
import math
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

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

    def __enter__(self) -> Self:
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
    from ``reference``."""
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


def measure_each(shape: str, variants: dict[str, Callable], measure_one: Callable[[str, Callable], dict],
                 save: Callable[[dict], object]) -> None:
    """``save`` ``measure_one(name, fn)``'s row for each variant; one that fails gives an error row and the others
    still run."""
    for name, fn in variants.items():
        try:
            row = measure_one(name, fn)
        except Exception as exc:  # noqa: BLE001 - keep the other variants' rows
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            row = {"shape": shape, "config": name, "error": f"{type(exc).__name__}: {first_line}"}
        save(row)


def table(rows: list[dict], columns: dict[str, Callable[[dict], object]]) -> None:
    """Print ``rows`` as a table: shape, config, then ``columns``."""
    print("| shape | config | " + " | ".join(columns) + " |")
    for r in rows:
        cells = [f"error: {r['error'][:80]}", *[""] * (len(columns) - 1)] if "error" in r else [
            str(cell(r)) for cell in columns.values()]
        print(f"| {r['shape']} | {r['config']} | " + " | ".join(cells) + " |")


def compiled_facts(fn: Any, signature: dict, constants: dict, attrs: dict, arch: int, options: dict) -> dict:
    """A Triton function compiled for ``sm_<arch>``: its PTX's global memory instructions by width and, from the
    triton wheel's ptxas, its registers and spilled bytes (or ptxas's last line where it gave none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    widths = collections.Counter(f"{op} {width}" for op, width in
                                 re.findall(r"\b(ld|st)\.global(?:\.[A-Za-z0-9_:]+)*?\.((?:v[248]\.)?b\d+)\b", ptx))
    facts: dict = {"global_memory_instructions": dict(sorted(widths.items()))}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "kernel.ptx").write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{'a' if arch == 90 else ''}", "-v",
                               "kernel.ptx", "-o", "kernel.cubin"], cwd=folder, capture_output=True, text=True,
                              check=False)
    report = done.stdout + done.stderr
    if (registers := re.search(r"Used (\d+) registers", report)) is not None:
        facts["registers"] = int(registers.group(1))
        facts["spilled_bytes"] = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    else:
        facts["ptxas"] = report.strip().splitlines()[-1:] or ["no output"]
    return facts
