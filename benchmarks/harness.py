"""What every benchmark shares: the device switch, timing, compile and profile readings, the spec overrides of a
compile or quantization variant, result rows, and the one ``main`` skeleton (``run_benchmark``).

A shared module: it imports no benchmark module (``tests/test_benchmark_smoke.py`` checks), and nothing at import
time but the standard library and torch, so a kernel benchmark runs where diffusers and omnispec are not installed.
Read the device switch as ``harness.SMOKE`` and ``harness.DEVICE`` at call time: ``enable_smoke`` changes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Self

import torch

ROOT = Path(__file__).resolve().parents[1]

# ---- the device switch -----------------------------------------------------------------------------------------------

SMOKE = False  # --smoke: tiny models on the CPU, to check a script without a GPU (its numbers mean nothing)
DEVICE = "cuda"
_SMOKE_HOOKS: list[Callable[[], None]] = []


def on_smoke(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` when the benchmark switches to smoke (now, if it already has): how a shared table of sizes
    shrinks to its tiny ones."""
    _SMOKE_HOOKS.append(hook)
    if SMOKE:
        hook()
    return hook


def enable_smoke() -> None:
    """Tiny models (one block, two heads of 16 dims, tiny encoders and VAEs) at small sizes on the CPU, few steps:
    checks a benchmark script without a GPU (its numbers mean nothing)."""
    global SMOKE, DEVICE
    SMOKE, DEVICE = True, "cpu"
    for hook in _SMOKE_HOOKS:
        hook()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_device_memory(compiled: bool = False) -> None:
    """Collect dropped modules and return the device cache, so the next build starts from an empty GPU. With
    ``compiled``, also drop what torch.compile keeps process-wide (``torch.compiler.reset``: its code caches and the
    CUDA-graph trees' memory pools, which hold the dropped modules' recorded graphs and outputs); a later call of a
    module compiled before compiles again."""
    if compiled:
        torch.compiler.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---- timing ----------------------------------------------------------------------------------------------------------

def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    """The bf16 matmul FLOP/s this GPU reaches on ``n``³ products (MFU's denominator); 1e12 off CUDA (smoke)."""
    if DEVICE != "cuda":
        return 1e12
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def per_step(run, lo: int, hi: int, repeats: int, queued: list[float] | None = None) -> tuple[float, list[float]]:
    """Median seconds per step ((time of ``hi`` steps - time of ``lo``) / (hi - lo)) and the samples. ``queued``, if
    given, collects how long the device was still busy after each ``run(hi)`` returned (the wait in the synchronize
    after it): near zero means the host set the pace, not the device."""
    samples = []
    for _ in range(repeats):
        times = {}
        for n in (lo, hi):
            sync()
            start = time.perf_counter()
            run(n)
            returned = time.perf_counter()
            sync()
            times[n] = time.perf_counter() - start
            if n == hi and queued is not None:
                queued.append(time.perf_counter() - returned)
        samples.append((times[hi] - times[lo]) / (hi - lo))
    return statistics.median(samples), samples


def warm_up(run, lo: int, hi: int, rounds: int = 1) -> None:
    """Run ``lo`` and then ``hi`` steps ``rounds`` times before timing, as ``per_step`` will: a compiled side
    compiles, and its CUDA-graph trees warm up and record, for each request length it is timed at. Warmed at ``lo``
    alone, its first timed ``hi`` run (and a recompile for the second length's shapes, or a recording) lands inside
    a sample, which then can even come out negative."""
    for _ in range(rounds):
        for n in (lo, hi):
            run(n)


def warm_up_rounds(overrides) -> int:
    """``warm_up``'s rounds for a side built with ``overrides``: two where they may compile (a compile policy, a
    preset), whose CUDA-graph trees warm up on one call and record on the next; one otherwise."""
    return 2 if any(word in o for o in overrides for word in ("compile", "preset")) else 1


def warm_up_sides(sides: dict, lo: int, hi: int, overrides, also) -> None:
    """``warm_up`` for each side of a comparison: ``diffusers`` as given, ``omnispec`` built with ``overrides``, any
    other (``--also``'s third side) with ``also`` too."""
    for label, run in sides.items():
        built_with = {"diffusers": (), "omnispec": overrides}.get(label, [*overrides, *also])
        warm_up(run, lo, hi, warm_up_rounds(built_with))


def per_step_sides(sides: dict, lo: int, hi: int, repeats: int) -> dict[str, tuple[float, list[float]]]:
    """``per_step`` for several sides at once, one sample of each per round, the order reversed every other round:
    clocks that drift during a call (the GPU warming up, a neighbour's load) then hit every side alike, where
    timing one side's repeats after the other's would put the whole drift between them."""
    samples: dict[str, list[float]] = {label: [] for label in sides}
    order = list(sides)
    for r in range(repeats):
        for label in order if r % 2 == 0 else order[::-1]:
            samples[label].append(per_step(sides[label], lo, hi, 1)[1][0])
    return {label: (statistics.median(times), times) for label, times in samples.items()}


def per_request(run, steps: int, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of a whole ``steps``-step request without gradients, and the samples."""
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            run(steps)
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


def first_call_s(run) -> float:
    """Seconds of a one-step run: on a compiled module, the compilation."""
    start = time.perf_counter()
    with torch.no_grad():
        run(1)
    sync()
    return time.perf_counter() - start


def first_output(run, *modules: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """The first row of a denoiser's first output in a one-step run (the cond pass of step 0 on every side: omnispec
    batches CFG passes into one forward, diffusers' Wan runs them one by one), as float32 on the host, and that run's
    seconds (a compiled module's compilation). With several ``modules`` (two experts), whichever runs first."""
    seen: list[torch.Tensor] = []

    def keep(_m, _a, out):
        if not seen:
            out = out.sample if hasattr(out, "sample") else out
            out = out[0] if isinstance(out, (tuple, list)) else out
            seen.append(out[:1].detach().float().cpu())

    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        seconds = first_call_s(run)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0], seconds


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors' values, flattened, in float64: float32's sums read high over a video's
    millions of values (BENCHMARKS.md, "How the figures are taken", Cosines)."""
    return torch.nn.functional.cosine_similarity(a.double().flatten().cpu(), b.double().flatten().cpu(), dim=0).item()


def flops_per_step(run, steps: int = 1) -> float:
    """FLOPs of a ``steps``-step run (plus the tiny text encoders): one denoise step's with the default."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad():
        run(steps)  # warm-up: first-use work (auto attention trials, compilation) must not be counted
    counter = FlopCounterMode(display=False)
    # eager: a compiled frame run under a dispatch mode is skipped by dynamo, and skipped for good (torch 2.11 and
    # 2.13), so the compiled sides would then time eager blocks whose nested calls dynamo compiles one by one
    with torch.compiler.set_stance("force_eager"), counter, torch.no_grad():
        run(steps)
    return float(counter.get_total_flops())


# ---- what compilation did, where a long call waits, where device time goes -------------------------------------------

# Phases of a compilation, as torch._dynamo.utils.compile_times names them: all of it, dynamo's bytecode tracing,
# AOTAutograd, inductor's code generation (a warm inductor cache shortens the last, never the first two).
COMPILE_PHASES = {"total": "_compile.compile_inner", "dynamo tracing": "bytecode_tracing",
                  "aot autograd": "create_aot_dispatcher_function", "inductor": "fx_codegen_and_compile"}


def _compile_seconds() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    spent = dict(zip(names, (float(v) for v in values)))
    return {phase: spent.get(name, 0.0) for phase, name in COMPILE_PHASES.items()}


class CompileWatch:
    """Counts what dynamo does while a block runs: frames compiled, graphs, graph breaks, recompiles with
    their first guard failures, and the seconds each compilation phase took. A compiled region that recompiles
    per block, or breaks its graph, shows here rather than as an unexplained slow or noisy step time."""

    def __init__(self) -> None:
        self.recompiles: list[str] = []

    def __enter__(self) -> Self:
        import logging

        from torch._dynamo.utils import counters

        self._start = {"graphs": counters["stats"]["unique_graphs"],
                       "breaks": sum(counters["graph_break"].values())}
        self._seconds = _compile_seconds()
        torch._logging.set_logs(recompiles=True)
        self._logger = logging.getLogger("torch._dynamo.guards.__recompiles")
        self._handler = logging.Handler()
        self._handler.emit = lambda record: self.recompiles.append(record.getMessage())  # type: ignore[method-assign]
        self._logger.addHandler(self._handler)
        self._logger.propagate = False  # collected, not printed
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.propagate = True
        torch._logging.set_logs()

    def summary(self) -> dict:
        from torch._dynamo.utils import counters

        reasons = [re.sub(r"\s+#.*", "", line.strip()) for msg in self.recompiles for line in msg.splitlines()
                   if re.match(r"\s*- \d+/\d+: ", line)]
        breaks = counters["graph_break"]
        return {"graphs": counters["stats"]["unique_graphs"] - self._start["graphs"],
                "graph_breaks": sum(breaks.values()) - self._start["breaks"],
                "graph_break_reasons": [r[:160] for r, _ in breaks.most_common(3)],
                "recompiles": len(self.recompiles),
                "recompile_reasons": list(dict.fromkeys(r[:200] for r in reasons))[:6],
                "compile_seconds": {k: round(v - self._seconds[k], 2) for k, v in _compile_seconds().items()}}


class StackSampler:
    """Where the main thread spends a long first call: its Python stack sampled every ``interval`` seconds from a
    side thread, so time that dynamo's compile metrics do not count (kernel compilation in worker processes,
    autotuning at first launch, guard evaluation, the run itself) still shows where it went. ``top()`` gives the
    innermost frames seen most (where the time is spent, the last frames of the stack) and the functions seen most
    anywhere on the stack. With ``dump_to``, ``top()`` is also written there every ``dump_every_s`` seconds, so a
    call cut by a timeout still leaves its samples."""

    def __init__(self, interval: float = 0.5, dump_to: Path | None = None, dump_every_s: float = 15.0) -> None:
        self.interval, self.samples, self.dump_to, self.dump_every_s = interval, 0, dump_to, dump_every_s
        self.counts: dict[str, int] = {}
        self.innermost: dict[str, int] = {}

    def __enter__(self) -> Self:
        import sys
        import threading

        main, self._stop = threading.main_thread().ident, threading.Event()
        every = max(1, round(self.dump_every_s / self.interval))

        def sample() -> None:
            while not self._stop.wait(self.interval):
                frame, stack = sys._current_frames().get(main), []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_name}")
                    frame = frame.f_back
                for key in set(stack):
                    self.counts[key] = self.counts.get(key, 0) + 1
                if stack:
                    leaf = " < ".join(stack[:4])
                    self.innermost[leaf] = self.innermost.get(leaf, 0) + 1
                self.samples += 1
                if self.dump_to is not None and self.samples % every == 0:
                    self.dump_to.write_text(json.dumps(self.top(), indent=1))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.dump_to is not None:
            self.dump_to.write_text(json.dumps(self.top(), indent=1))

    def top(self, n: int = 25) -> dict:
        def ranked(counts: dict[str, int]) -> dict[str, float]:
            return {key: round(count * self.interval, 1)
                    for key, count in sorted(counts.items(), key=lambda kv: -kv[1])[:n]}

        return {"samples": self.samples, "interval_s": self.interval, "innermost": ranked(self.innermost),
                "functions": ranked(self.counts)}


def stacks_file(results: Path | None, label: str) -> Path | None:
    """Where a ``StackSampler`` for ``label`` writes, beside the results file (None without one)."""
    if results is None:
        return None
    return results.with_name(f"{results.stem}_stacks_{re.sub(r'[^a-z0-9]+', '_', label.lower()).strip('_')}.json")


# Kernel families of a profiled step, by kernel name (first match wins): where a compiled step's device time goes.
# fp8 GEMMs: cuBLAS names them by input types (nvjet "qq": e4m3 x e4m3, "ovscale": per-row scales); inductor names
# the kernels that compute an fp8 linear's activation scales and casts after the _scaled_mm they feed
KERNEL_KINDS = (("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.IGNORECASE)),
                ("fp8 matmul", re.compile(r"e4m3|f8f8|nvjet_sm\d+_qq|ovscale", re.IGNORECASE)),
                ("fp8 activation quantization", re.compile(r"^triton_.*_scaled_mm", re.IGNORECASE)),
                ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|_mm_|addmm", re.IGNORECASE)),
                ("fused by inductor", re.compile(r"^triton_", re.IGNORECASE)),
                ("copy and cast", re.compile(r"copy|cast|memcpy|memset|to_copy", re.IGNORECASE)))


def kernel_summary(prof, per: int, unit: str, largest: int = 12, per_kind: int = 5) -> dict:
    """A finished profile's device kernels, grouped by ``KERNEL_KINDS``, in ms per ``per`` (steps, rollouts), with
    the ``largest`` kernels by time and each kind's ``per_kind`` largest (what makes up "other", say); on the CPU
    (smoke runs), the operators' CPU time instead."""
    device = DEVICE == "cuda"
    kernels = {}
    for event in prof.key_averages():
        spent = event.self_device_time_total if device else event.self_cpu_time_total  # microseconds
        if spent > 0 and (not device or event.device_type.name == "CUDA"):
            kernels[event.key] = (kernels.get(event.key, (0.0, 0))[0] + spent, event.count)
    per_unit = {name: (us / 1e3 / per, count / per) for name, (us, count) in kernels.items()}
    kinds: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for name, (ms, _) in per_unit.items():
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
        members.setdefault(kind, []).append(name)

    def rows(names: list[str], n: int) -> list[dict]:
        top = sorted(names, key=lambda name: -per_unit[name][0])[:n]
        return [{"kernel": name[:120], f"ms{unit}": per_unit[name][0], f"calls{unit}": per_unit[name][1]}
                for name in top]

    return {f"device_busy_ms{unit}": sum(kinds.values()),
            f"kinds_ms{unit}": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "largest": rows(list(per_unit), largest),
            "largest_per_kind": {kind: rows(names, per_kind) for kind, names in members.items()}}


# ---- compile and quantization variants as spec overrides -------------------------------------------------------------

# Variant options that change the model rather than the compile policy (an experiment of the benchmarks):
# ``fused_qkv`` runs diffusers' ``fuse_qkv_projections`` on the transformer first (one matmul for each attention's
# query, key and value, and one for the text stream's), before any quantization, so fp8 quantizes the fused linear.
MODEL_OPTIONS = ("fused_qkv",)
# Variant options that set another policy's field.
POLICY_OPTIONS = {"qk_norm_rope": "policies.attention.fused_qk_norm_rope=true",
                  "fused_gelu": "policies.mlp.fused_gelu=true",
                  "flash4": "policies.attention.default=flash4",
                  "modulation": "policies.mlp.precomputed_modulation=true"}


def compile_overrides(variant: str) -> list[str]:
    """``regional+cudagraphs`` -> the overrides of compile mode regional with its cudagraphs option on;
    ``+no_OPTION`` turns an option off (``regional+no_eager_rounding``), ``+OPTION=VALUE`` sets one
    (``regional+backend=aot_eager``); ``MODEL_OPTIONS`` are left to the benchmark that applies them."""
    mode, *options = variant.split("+")
    return [f"policies.compile.mode={mode}", *(POLICY_OPTIONS.get(option) or _compile_option(option)
                                               for option in options if option not in MODEL_OPTIONS)]


def _compile_option(option: str) -> str:
    """``cudagraphs`` -> on, ``no_eager_rounding`` -> off, ``backend=aot_eager`` -> that value."""
    if "=" in option:
        return f"policies.compile.{option}"
    return f"policies.compile.{option.removeprefix('no_')}={'false' if option.startswith('no_') else 'true'}"


def inductor_only(variant: str) -> bool:
    """Whether ``variant`` sets a compile option only inductor has (cudagraphs, autotune, ...): the smoke's
    aot_eager backend has none, so the smoke leaves such variants out."""
    return any(option not in (*MODEL_OPTIONS, *POLICY_OPTIONS) for option in variant.split("+")[1:])


def quantized_transformer(method: str, granularity: str | None = None, exclude: list[str] = ()) -> tuple[str, str]:
    """The override quantizing the transformer (``method``, fp8 ``granularity``, modules ``exclude``d) and a label
    for its rows, e.g. ``fp8_dynamic row (not norm1, norm)``."""
    fields = [f"method: {method}", *([f"granularity: {granularity}"] if granularity else []),
              *([f"exclude: [{', '.join(exclude)}]"] if exclude else [])]
    policy = f"policies.quantization={{transformer: {{{', '.join(fields)}}}}}"
    label = f"{method}{' ' + granularity if granularity else ''}" + (f" (not {', '.join(exclude)})" if exclude else "")
    return policy, label


def compiled(module: Callable) -> Callable:
    """``module`` compiled whole with omnispec's compile options (``compile: regional``'s; aot_eager under smoke,
    since inductor's CPU code generation is slow for the suite and the smoke checks the script)."""
    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec.policies import CompilePolicy

    torch._dynamo.reset()
    if SMOKE:
        return torch.compile(module, fullgraph=True, backend="aot_eager")
    return torch.compile(module, fullgraph=True, options=_torch_compile_options(CompilePolicy(mode="regional")))


# ---- result rows and the main skeleton -------------------------------------------------------------------------------

def show(line: dict) -> None:
    """Print ``line`` as one JSON line (a row, or what a run reports on its way)."""
    print(json.dumps(line, default=str), flush=True)


class Results:
    """A benchmark's result rows: ``save(row)`` prints the row as one JSON line and rewrites the ``--json`` file with
    every row so far, so a call cut short still leaves what it measured. The file holds ``{**header, "rows": rows}``
    (``layout="rows"``), the rows alone (``"list"``), or the header alone (``"document"``: a result that is one
    document, not rows)."""

    def __init__(self, path: Path | None = None, layout: Literal["rows", "list", "document"] = "rows") -> None:
        self.path, self.layout = path, layout
        self.header: dict = {}
        self.rows: list[dict] = []

    def save(self, row: dict) -> dict:
        self.rows.append(row)
        show(row)
        self.write()
        return row

    def write(self) -> None:
        if self.path is None:
            return
        document = {"rows": {**self.header, "rows": self.rows}, "list": self.rows, "document": self.header}
        self.path.write_text(json.dumps(document[self.layout], indent=1, default=str) + "\n")


class UsageError(Exception):
    """A benchmark's arguments that do not fit together: reported as argparse reports a bad flag (exit code 2)."""


SMOKE_HELP = "tiny models on the CPU (checks the script only; its numbers mean nothing)"


def hold_device_memory(gib: float) -> float | None:
    """Hold this process to ``gib`` of the GPU's memory, as a smaller card would; returns the cap (None off CUDA,
    where there is nothing to hold). A cap above the card's memory is refused."""
    if DEVICE != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    if gib * 2**30 > total:
        raise UsageError(f"--device-memory-gib {gib}: this GPU has {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
    return gib


def run_benchmark(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                  body: Callable[[argparse.Namespace, Results], None], *, smoke: str | None = SMOKE_HELP,
                  layout: Literal["rows", "list", "document"] = "rows", needs_cuda: bool = False) -> None:
    """Every benchmark's ``main``: the parser (``doc``'s first line as its description, the rest as its epilog;
    the benchmark's own flags from ``add_arguments``, then ``--json FILE`` and, unless ``smoke`` is None,
    ``--smoke`` with ``smoke`` as its help), the switch to smoke, and ``body(args, results)``, whose rows
    ``results.save`` prints and keeps in ``--json``'s file as they come. ``needs_cuda``: refuse to start without
    CUDA unless ``--smoke``."""
    title, _, story = doc.strip().partition("\n")
    parser = argparse.ArgumentParser(description=title, epilog=story.strip() or None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="keep the results in this JSON file too (rewritten as each row comes)")
    parser.add_argument("--device-memory-gib", type=float, metavar="GIB",
                        help="hold this process to GIB of GPU memory (torch's per-process fraction), e.g. 79.1 for "
                             "an 80 GB card's on a larger one; the results' header says so")
    if smoke is not None:
        parser.add_argument("--smoke", action="store_true", help=smoke)
    args = parser.parse_args()
    if getattr(args, "smoke", False):
        enable_smoke()
    elif needs_cuda and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    results = Results(args.json, layout)
    try:
        if args.device_memory_gib:
            results.header["device_memory_cap_gib"] = hold_device_memory(args.device_memory_gib)
        body(args, results)
    except UsageError as exc:
        parser.error(str(exc))
