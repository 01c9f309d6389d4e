"""Compile, step caching, fp8, offload and two-GPU parallel at real sizes (random bf16 weights), side by side.
Peer: cache-dit and xDiT (and diffusers' own call where it has one), on the same in-memory modules handed to each
engine, every time a ratio to the same plain eager diffusers run measured in the same call, medians of repeats,
every row recording its engine's version and settings (issue 19).

One H200, one part per call (each call measures its own eager baseline; sized for the 10-minute command limit
from the step times in BENCHMARKS.md, not yet timed on a GPU):
    python -m benchmarks.gpu_peers --workloads flux --parts compile [--json FILE]
    python -m benchmarks.gpu_peers --workloads flux --parts step_mask,dbcache
    python -m benchmarks.gpu_peers --workloads flux --parts fp8
    python -m benchmarks.gpu_peers --workloads flux --parts offload
    python -m benchmarks.gpu_peers --workloads wan --parts compile --repeats 2
    python -m benchmarks.gpu_peers --workloads wan --parts step_mask --repeats 2
    python -m benchmarks.gpu_peers --workloads wan --parts dbcache --repeats 2 --cache-steps wan=6 --search-probes 4
    python -m benchmarks.gpu_peers --workloads wan --parts fp8 --repeats 2
Two H200s of one host:
    torchrun --nproc-per-node 2 -m benchmarks.gpu_peers --parallel --workloads flux [--json FILE]
    torchrun --nproc-per-node 2 -m benchmarks.gpu_peers --parallel --workloads wan --repeats 2
On a CPU, to check the script (tiny modules, float32, gloo; its numbers mean nothing). cache-dit's quantization and
diffusers' ``enable_parallelism`` need an accelerator (their rows record the error); xDiT runs through a
smoke-only shim (``_xfuser_on_cpu``) when triton is importable, since xfuser imports it unconditionally:
    python -m benchmarks.gpu_peers --smoke
    torchrun --nproc-per-node 2 -m benchmarks.gpu_peers --parallel --smoke

Workloads: FLUX.1-dev 1024² (embedded guidance 3.5; ``--parallel`` adds true CFG 4 with a negative prompt, as
``gpu_parallel`` does, so CFG-parallel has two passes to split) and Wan2.1 14B 480x832x81 (CFG 5, two forwards
a step in diffusers). Text encoders are one-layer stand-ins of the real widths (``workloads``).

Single-GPU parts. ``eager`` is diffusers' own pipeline on the untouched modules; peers run on deep copies of the
denoiser (what they patch stays off the originals); omnispec builds over the modules with ``attention: sdpa``.
- compile: per-step time (N_hi - N_lo steps) of cache-dit's compile path against omnispec ``compile: regional``
  (``--omnispec-compile``: other omnispec configurations, as gpu_policies' ``--compile-variants``);
  compile seconds, what dynamo did, first denoiser output's cosine to eager. ``--compile-rounds N`` then keeps the
  first omnispec configuration and cache-dit's built and times them in N interleaved rounds (ABBA): one paired ratio
  a round, which the clock's drift between processes at the power cap does not reach. ``--compile-extra`` adds
  omnispec regional under cache-dit's inductor settings (separates the settings from the regions compiled).
- step_mask: one fixed compute/reuse pattern, cache-dit's ``steps_mask(total_steps, mask_policy)``, run by
  cache-dit (``DBCacheConfig(steps_computation_mask=..., steps_computation_policy="static")``) and by omnispec
  (``cache: {kind: step_mask, mask: ...}``); whole-request time at the workload's cache steps.
- dbcache: cache-dit's DBCache (``--dbcache F1B0W0``: Fn compute blocks, Bn, warm-up steps; ``--dbcache-threshold``)
  and omnispec ``first_block`` at the threshold, searched per row, that gives the same number of full forwards.
- fp8: cache-dit ``quantize(QuantizeConfig(quant_type="float8_per_row"))`` + its compile path against omnispec
  ``fp8_dynamic`` (``granularity: row``) + ``compile: regional``; quantized Linear counts, cosine to bf16.
- offload (FLUX; ``--offload-workloads`` adds Wan): whole requests, a new prompt each time, of omnispec ``offload: model`` and diffusers'
  ``enable_model_cpu_offload`` (each on its own copy of the modules, so their requests alternate), against the
  resident run; then one profiled request each: host<->device copies by kind (pageable or pinned), bytes, GPU ms,
  and when they happen (bursts from the request's start), from torch.profiler's trace.
Every caching row counts, on both sides, denoiser calls, rows (sample-passes) reaching the last block ("full
forwards") and block computes in full-forward units, from pre-hooks on each block's attention module (a
skipped block never reaches it, whichever way it is skipped).

Two GPUs (``--parallel``, ``torchrun --nproc-per-node 2``): per-step time against diffusers' single-GPU eager run
(rank 0, same call), fresh identical modules per configuration (parallelism attaches to modules once), final
latents' cosine to that run: omnispec single, cfg 2 and ulysses 2; diffusers ``enable_parallelism`` ulysses 2;
cache-dit ulysses 2 (and with ``ulysses_async``); xDiT ulysses 2. CFG 2 rows for cache-dit and xDiT state why they
are not run (cache-dit 1.5.3's ``ParallelismConfig`` has ulysses, ring and tp sizes only; xfuser 0.7.0's FLUX.1-dev
and Wan2.1-T2V runners declare no ``use_cfg_parallel``, and ``xFuserFluxPipeline`` is wrapped with
``cfg_parallel_available=False``).

How the peers are configured (read from their installed sources, cache-dit 1.5.3 and xfuser 0.7.0):
- cache-dit: ``cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))`` on a pipeline of a per-row subclass
  of the diffusers class (cache-dit patches ``pipe.__class__.__call__``, so the eager baseline's class stays
  clean); ``cache_dit.enable_cache(pipe, parallelism_config=ParallelismConfig(ulysses_size=2))``; compile path as
  its CLI does it: ``cache_dit.set_compile_configs()``, ``torch.set_float32_matmul_precision("high")``,
  ``transformer.compile_repeated_blocks(fullgraph=False)`` (its process-wide inductor/dynamo settings are saved
  and restored around its rows, and dynamo's caches reset between compiled rows); ``cache_dit.quantize``.
  cache-dit's quantization also patches torchao's ``_choose_scale_float8`` process-wide, so its fp8 row runs last.
- xDiT: as its ``xFuserModelRunner`` does for these models, with in-memory weights: ``init_distributed_environment()``,
  ``xFuserArgs(model=..., ulysses_degree=2, ...).create_config()``, the runner's transformer class
  (``xFuserFlux1Transformer2DWrapper`` / ``xFuserWanTransformer3DWrapper``, the latter with the runner's
  ``_build_attention_kwargs``) built from the same config and given the same tensors
  (``load_state_dict(..., assign=True)``), diffusers' ``FluxPipeline`` / ``WanPipeline`` around it,
  ``initialize_runtime_state(pipe, engine_config)``; per request FLUX ``set_input_parameters(...)``, Wan
  ``reset_vsa_schedule_state(steps)``. Its attention backend is its own choice (CUDNN on an H200 without
  flash-attn 3/4), recorded per row.

Wheels for the GPU machine (python 3.12, torch 2.11, no network): besides the project's usual set, four pure-Python
wheels (1.7 MB together), so one fetch in the repo root is
    bash ../shared/tools/device-wheels.sh peft==0.21.2 torchao==0.17.0 accelerate psutil \
        cache-dit==1.5.3 xfuser==0.7.0 yunchang==0.6.4 distvae==0.1.0
cache-dit needs packaging, pyyaml, torch, diffusers, transformers (+ einops for parallelism, torchao for
quantization); xfuser needs accelerate, transformers, sentencepiece, einops, diffusers, peft, numpy, pyyaml,
yunchang and distvae (imported at module level); all but the four above are on the image or in the usual set.
Not needed: beautifulsoup4 (imported only if present), av (36 MB; imported only to write videos), flash-attn
(xDiT then picks cuDNN attention), ray, bitsandbytes. xfuser's wheel also puts ``benchmarks``, ``tests``,
``examples``... folders at the top of site-packages; ``-m benchmarks.gpu_peers`` still finds this repo's package
first (the working directory leads sys.path), but remove them after installing to be sure:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && rm -rf /tmp/site/benchmarks /tmp/site/tests && export PYTHONPATH=/tmp/site:$PWD || exit;
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import inspect
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # cache-dit logs every config at info level
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines

import torch

from . import harness
from .workloads import flux_components, parallel_overrides, plain_copy, tiny_components, wan_components

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a photo of a cat"
# steps: (N_lo, N_hi) of per-step times; parallel_steps: the same under --parallel; cache_steps: request steps of
# the caching parts (Wan's 6.5 s steps keep its counts low; --cache-steps changes them)
WORK = {
    "flux": {"spec": "flux1-dev.yaml", "pipeline": "FluxPipeline", "steps": (2, 6), "parallel_steps": (2, 6),
             "cache_steps": 28, "request": {"height": 1024, "width": 1024, "max_sequence_length": 512},
             "diffusers": {"height": 1024, "width": 1024, "guidance_scale": 3.5, "max_sequence_length": 512},
             "xdit_model": "black-forest-labs/FLUX.1-dev"},
    "wan": {"spec": "wan2.1-t2v-1.3b.yaml", "pipeline": "WanPipeline", "steps": (1, 3), "parallel_steps": (1, 2),
            "cache_steps": 8, "request": {"height": 480, "width": 832, "frames": 81, "max_sequence_length": 512},
            "diffusers": {"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 5.0,
                          "max_sequence_length": 512},
            "xdit_model": "Wan-AI/Wan2.1-T2V-14B-Diffusers"},
}
SMOKE_OVERRIDES: list[str] = []  # --smoke: the tiny modules are float32
RESULTS = harness.Results()  # the run's rows (``benchmark`` hands it the one with ``--json``'s file)
_TAKES = itertools.count()


@harness.on_smoke
def _tiny_work() -> None:
    """Tiny float32 modules on the CPU at 32 px (frames 5 for Wan), few steps: checks every code path fast."""
    SMOKE_OVERRIDES[:] = ["model.dtype=float32"]
    for w in WORK.values():
        video = "frames" in w["request"]
        tiny = {"height": 32, "width": 32, "max_sequence_length": 16}
        w["request"] |= tiny | ({"frames": 5} if video else {})
        w["diffusers"] |= tiny | ({"num_frames": 5} if video else {})
        w["steps"], w["parallel_steps"], w["cache_steps"] = (1, 2), (1, 2), 8


# ---- versions, rows ---------------------------------------------------------------------------------------------

def versions() -> dict:
    import omnispec

    out = {"torch": torch.__version__, "omnispec": omnispec.__version__}
    for dist in ("diffusers", "transformers", "torchao", "accelerate", "cache-dit", "xfuser", "yunchang"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


VERSIONS: dict = {}
ENGINE_DIST = {"diffusers": "diffusers", "omnispec": "omnispec", "cache-dit": "cache-dit", "xDiT": "xfuser"}


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def emit(row: dict) -> dict:
    row = {"version": VERSIONS.get(ENGINE_DIST.get(row.get("engine"), ""), None), **row}
    if _is_main():
        RESULTS.save(row)
    return row


def error_row(part: str, workload: str, engine: str, config: str, exc: BaseException | str, **extra) -> dict:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return emit({"part": part, "workload": workload, "engine": engine, "config": config, "error": text[:400], **extra})


def _ratios(seconds: float, eager: float) -> dict:
    return {"time_ratio_vs_eager": seconds / eager, "speedup_vs_eager": eager / seconds}


def _peer(module: str):
    """Import a peer, or raise with what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"{module} is not installed here ({exc}); see this script's docstring for the wheels") from exc


# ---- modules and runs -----------------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, dict] = {}


def _shared_tokenizers(name: str, mods: dict) -> dict:
    """One set of tokenizers per workload for every configuration and every rank. The offline tokenizers are
    trained here, and training is not deterministic (ties broken in hash order: two ``clip_tokenizer()`` calls
    give different ids for this prompt), so fresh ones per configuration or per rank would feed each run, or
    each rank of one run, other token ids. Under torchrun rank 0 saves its set and every rank loads it."""
    import torch.distributed as dist

    keys = [k for k in mods if k.startswith("tokenizer")]
    if name not in _TOKENIZERS:
        if dist.is_initialized() and dist.get_world_size() > 1:
            root = Path(tempfile.gettempdir()) / f"omnispec_gpu_peers_{name}_{os.environ.get('MASTER_PORT', '0')}"
            if dist.get_rank() == 0:
                for k in keys:
                    mods[k].save_pretrained(root / k)
            dist.barrier()
            _TOKENIZERS[name] = {k: type(mods[k]).from_pretrained(root / k) for k in keys}
        else:
            _TOKENIZERS[name] = {k: mods[k] for k in keys}
    return mods | _TOKENIZERS[name]


def components(name: str) -> dict:
    """Random modules made from one seed, so every rank and every configuration gets the same weights (and
    the same tokenizers)."""
    torch.manual_seed(0)
    if harness.DEVICE == "cuda":
        torch.cuda.manual_seed_all(0)
    mods = tiny_components(name) if harness.SMOKE else {"flux": flux_components, "wan": wan_components}[name]()
    return _shared_tokenizers(name, mods)


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    if hasattr(transformer, "single_transformer_blocks"):
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return list(transformer.blocks)


def _prompt(fresh: bool) -> str:
    return f"{PROMPT}, take {next(_TAKES)}" if fresh else PROMPT


def diffusers_pipeline(name: str, mods: dict, transformer: torch.nn.Module | None = None, cls: type | None = None):
    import diffusers

    cls = cls or getattr(diffusers, WORK[name]["pipeline"])
    pipe = cls(**{**mods, "transformer": transformer if transformer is not None else mods["transformer"]})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def clean_class(name: str) -> type:
    """A fresh subclass of the diffusers pipeline class, with the same name (cache-dit finds its adapter by
    class name and patches ``__call__`` on the class: that must not reach the eager baseline's class)."""
    import diffusers

    base = getattr(diffusers, WORK[name]["pipeline"])
    return type(base.__name__, (base,), {})


def diffusers_runner(pipe, name: str, extra: dict | None = None, fresh: bool = False, before=None):
    """``run(n)`` -> final latents of an ``n``-step request (not decoded)."""
    kwargs = {**WORK[name]["diffusers"], **(extra or {})}

    def run(n: int) -> torch.Tensor:
        if before is not None:
            before(n)
        out = pipe(_prompt(fresh), num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="latent", **kwargs)
        return out.images if hasattr(out, "images") else out.frames

    return run


def omnispec_pipeline(name: str, mods: dict, overrides: list[str]):
    import omnispec

    return omnispec.build(ROOT / "specs" / WORK[name]["spec"], components=mods, device=harness.DEVICE,
                          overrides=["runtime.progress=false", "policies.attention.default=sdpa", *SMOKE_OVERRIDES,
                                     *overrides])


def omnispec_runner(pipe, name: str, extra: dict | None = None, fresh: bool = False):
    from omnispec.spec.request import resolve_request

    fields = {**WORK[name]["request"], **(extra or {})}

    def run(n: int) -> torch.Tensor:
        out = pipe.generate(resolve_request(pipe.spec, _prompt(fresh), 0, steps=n, **fields), decode=False)
        return out.latents["latents"]

    return run



def _peak_gib(run, n: int) -> float:
    if harness.DEVICE != "cuda":
        return 0.0
    harness.sync()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        run(n)
    harness.sync()
    return torch.cuda.max_memory_allocated() / 2**30


def _per_step(run, lo: int, hi: int, repeats: int) -> tuple[float, list[float]]:
    with torch.no_grad():
        return harness.per_step(run, lo, hi, repeats)



class ForwardCount:
    """Counts what the denoiser computes: its calls and rows (samples x passes), rows reaching the last block's
    attention ("full forwards") and rows through every block's attention, in full-forward units. Pre-hooks on
    the attention modules see only blocks that really run: cache-dit does not call a skipped block, diffusers'
    block hooks return before the block's own forward, and omnispec's step_mask skips the denoiser call."""

    def __init__(self, transformer: torch.nn.Module):
        self.blocks = _blocks(transformer)
        self.calls = self.rows = self.last = self.block_rows = 0
        self.handles = [transformer.register_forward_pre_hook(self._denoiser, with_kwargs=True)]
        final = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            attn = getattr(block, "attn1", None) or block.attn
            self.handles.append(attn.register_forward_pre_hook(
                lambda m, a, k, last=i == final: self._block(a, k, last), with_kwargs=True))

    @staticmethod
    def _n(args, kwargs) -> int:
        x = kwargs.get("hidden_states", args[0] if args else None)
        return int(x.shape[0]) if isinstance(x, torch.Tensor) else 1

    def _denoiser(self, module, args, kwargs):
        self.calls += 1
        self.rows += self._n(args, kwargs)

    def _block(self, args, kwargs, last: bool):
        n = self._n(args, kwargs)
        self.block_rows += n
        if last:
            self.last += n

    def summary(self) -> dict:
        return {"denoiser_calls": self.calls, "denoiser_rows": self.rows, "full_forwards": self.last,
                "block_computes_in_full_forwards": round(self.block_rows / len(self.blocks), 2)}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def counting(transformer: torch.nn.Module):
    counter = ForwardCount(transformer)
    try:
        yield counter
    finally:
        counter.remove()


@contextlib.contextmanager
def process_wide_compile_settings():
    """cache-dit's ``set_compile_configs`` changes inductor and dynamo settings for the whole process: keep
    them, and the float32 matmul precision, as they were for the rows that follow."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor, dynamo = inductor_config.get_config_copy(), dynamo_config.get_config_copy()
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        inductor_config.load_config(inductor)
        dynamo_config.load_config(dynamo)
        torch.set_float32_matmul_precision(precision)


def set_cachedit_settings() -> None:
    """cache-dit's process-wide settings, as its CLI sets them before compiling."""
    _peer("cache_dit").set_compile_configs()
    torch.set_float32_matmul_precision("high")


@contextlib.contextmanager
def cachedit_settings():
    """cache-dit's process-wide settings for what runs inside, the earlier ones back after (its interleaved rounds)."""
    with process_wide_compile_settings():
        set_cachedit_settings()
        yield


def _interleaved_row(wl: Workload, sides: dict[str, tuple], rounds: int) -> dict:
    """Two built and compiled sides' per-step times in ``rounds`` rounds, the order flipped each round (ABBA), and
    each round's ratio of the second side's time to the first's. The rounds are paired samples: the clock at the
    power cap moves both alike within a round, where separate processes differed by about 1.5% (BENCHMARKS.md,
    2026-12-04). An untimed round in each order comes first, since the first switches between the sides are slow:
    omnispec's first 2-step request after cache-dit's row once took half a second longer than its 6-step one, a
    negative per-step sample, and after one untimed run of each side the first timed round still gave one
    (2026-12-05)."""
    lo, hi = wl.w["steps"]
    names = list(sides)
    for n in names + names[::-1]:
        run, settings = sides[n]
        with settings():
            _per_step(run, lo, hi, 1)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for index in range(rounds):
        for n in names if index % 2 == 0 else names[::-1]:
            run, settings = sides[n]
            with settings():
                med, _ = _per_step(run, lo, hi, 1)
            samples[n].append(med * 1e3)
    first, second = names
    ratios = [b / a for a, b in zip(samples[first], samples[second], strict=True)]
    return emit({"part": "compile", "workload": wl.name, "engine": "both", "config": f"interleaved: {first} | {second}",
                 "rounds": rounds, "samples_ms": samples,
                 "median_ms_per_step": {n: statistics.median(v) for n, v in samples.items()},
                 "second_over_first_per_round": ratios, "second_over_first": statistics.median(ratios)})


def cachedit_compile(transformer: torch.nn.Module) -> dict:
    """cache-dit's compile path, as its CLI's ``maybe_compile_transformer`` runs it (``--compile``)."""
    set_cachedit_settings()
    transformer.compile_repeated_blocks(fullgraph=False)
    return {"call": "cache_dit.set_compile_configs(); torch.set_float32_matmul_precision('high'); "
                    "transformer.compile_repeated_blocks(fullgraph=False)"}


# ---- the single-GPU baseline ------------------------------------------------------------------------------------

class Workload:
    """One workload's modules and its plain eager diffusers run, shared by the parts of one call."""

    def __init__(self, name: str, repeats: int, ceiling: float):
        self.name, self.w, self.repeats, self.ceiling = name, WORK[name], repeats, ceiling
        self.mods = components(name)
        for m in self.mods.values():
            if isinstance(m, torch.nn.Module):
                m.to(harness.DEVICE)
        self.eager = diffusers_runner(diffusers_pipeline(name, self.mods), name)
        self._eager_step: dict | None = None
        self._requests: dict[int, dict] = {}

    def eager_step(self) -> dict:
        """Per-step time of the eager run, its first denoiser output (the cosine reference) and FLOPs."""
        if self._eager_step is None:
            lo, hi = self.w["steps"]
            with torch.no_grad():
                self.eager(lo)  # warm-up
            reference, _ = harness.first_output(self.eager, self.mods["transformer"])
            flops = harness.flops_per_step(self.eager)
            med, samples = _per_step(self.eager, lo, hi, self.repeats)
            self._eager_step = {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples],
                                "tflop_per_step": flops / 1e12, "mfu": flops / med / self.ceiling,
                                "peak_gib": _peak_gib(self.eager, lo), "reference": reference}
            emit({"part": "eager", "workload": self.name, "engine": "diffusers", "config": "eager (per step)",
                  "settings": {"pipeline": self.w["pipeline"], "attention": "diffusers default (native SDPA)",
                               "steps": [lo, hi]},
                  **{k: v for k, v in self._eager_step.items() if k != "reference"}})
        return self._eager_step

    def eager_request(self, steps: int) -> dict:
        """Whole-request time of the eager run at ``steps`` and its final latents."""
        if steps not in self._requests:
            with counting(self.mods["transformer"]) as count, torch.no_grad():
                latents = self.eager(steps)  # warm-up, reference output, forward count
            med, samples = harness.per_request(self.eager, steps, self.repeats)
            self._requests[steps] = {"request_s": med, "samples_s": samples, "latents": latents.float().cpu(),
                                     "forwards": count.summary()}
            emit({"part": "eager", "workload": self.name, "engine": "diffusers", "config": f"eager ({steps}-step request)",
                  "settings": {"pipeline": self.w["pipeline"], "steps": steps}, "request_s": med, "samples_s": samples,
                  "forwards": count.summary()})
        return self._requests[steps]

    def reset_modules(self) -> None:
        """A plain omnispec build removes every hook an earlier build put on the modules (cache, offload)."""
        omnispec_pipeline(self.name, self.mods, [])
        harness.free_device_memory()


def _step_row(wl: Workload, part: str, engine: str, config: str, settings: dict, run, module=None) -> dict:
    """A per-step row (compiled or not): compile seconds, dynamo activity, first denoiser output's cosine to
    eager, per-step time as a ratio to eager, peak memory."""
    eager = wl.eager_step()
    lo, hi = wl.w["steps"]
    with harness.CompileWatch() as watch:
        extra = {}
        if module is not None:
            out, first = harness.first_output(run, module)
            extra["denoiser_cosine_vs_eager"] = harness.cosine(out, eager["reference"])
        else:
            first = harness.first_call_s(run)
        with torch.no_grad():
            run(lo)
        med, samples = _per_step(run, lo, hi, wl.repeats)
    row = {"part": part, "workload": wl.name, "engine": engine, "config": config, "settings": settings,
           "first_call_s": first, **extra, "ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples],
           **_ratios(med * 1e3, eager["ms_per_step"]), "mfu": eager["tflop_per_step"] * 1e12 / med / wl.ceiling,
           "peak_gib": _peak_gib(run, lo), "dynamo": watch.summary()}
    return emit(row)


def _twin(wl: Workload) -> torch.nn.Module:
    """A deep copy of the untouched denoiser, on the device."""
    return plain_copy(wl.mods["transformer"]).to(harness.DEVICE)


# ---- part: compile ----------------------------------------------------------------------------------------------

def compile_part(wl: Workload, args) -> None:
    name = wl.name
    wl.eager_step()
    # with --compile-rounds the first omnispec row and cache-dit's stay built for the interleaved rounds after them
    sides: dict[str, tuple] = {}
    # omnispec first: cache-dit's process-wide settings must not reach it (they are restored anyway)
    for variant in args.omnispec_compile.split(","):
        label = "compile: " + variant.replace("+", " + ")
        try:
            twin = _twin(wl)
            overrides = harness.compile_overrides(variant)
            pipe = omnispec_pipeline(name, {**wl.mods, "transformer": twin}, overrides)
            applied = pipe.explain(as_dict=True).get("applied", {})
            run = omnispec_runner(pipe, name)
            _step_row(wl, "compile", "omnispec", label,
                      {"spec": overrides, "attention": pipe.explain(as_dict=True).get("attention"),
                       "explain": applied.get("compile"),
                       "mlp": applied.get("mlp"), "modulation": applied.get("modulation")}, run, twin)
            if args.compile_rounds and not sides:
                sides[f"omnispec {label}"] = (run, contextlib.nullcontext)
        except Exception as exc:  # noqa: BLE001 - keep the other rows
            error_row("compile", name, "omnispec", label, exc)
        pipe = twin = run = None
        if not sides:  # a kept side's compiled code stays
            harness.free_device_memory()
            torch._dynamo.reset()

    with process_wide_compile_settings():
        try:
            twin = _twin(wl)
            how = cachedit_compile(twin)
            run = diffusers_runner(diffusers_pipeline(name, wl.mods, twin), name)
            _step_row(wl, "compile", "cache-dit", "compile path", {**how, "pipeline": WORK[name]["pipeline"]}, run,
                      twin)
            if sides:
                sides["cache-dit compile path"] = (run, cachedit_settings)
        except Exception as exc:  # noqa: BLE001
            error_row("compile", name, "cache-dit", "compile path", exc)
        twin = run = None
    if len(sides) == 2:
        try:
            _interleaved_row(wl, sides, args.compile_rounds)
        except Exception as exc:  # noqa: BLE001
            error_row("compile", name, "both", "interleaved rounds", exc)
    sides.clear()
    harness.free_device_memory()
    torch._dynamo.reset()
    with process_wide_compile_settings():
        if args.compile_extra:
            try:
                set_cachedit_settings()
                twin = _twin(wl)
                pipe = omnispec_pipeline(name, {**wl.mods, "transformer": twin}, ["policies.compile.mode=regional"])
                _step_row(wl, "compile", "omnispec", "compile: regional, under cache-dit's inductor settings",
                          {"spec": "policies.compile={mode: regional}", "process": "cache_dit.set_compile_configs()"},
                          omnispec_runner(pipe, name), twin)
            except Exception as exc:  # noqa: BLE001
                error_row("compile", name, "omnispec", "compile: regional, under cache-dit's inductor settings", exc)
            pipe = twin = None
            harness.free_device_memory()
            torch._dynamo.reset()


# ---- parts: step caching ----------------------------------------------------------------------------------------

def _request_row(wl: Workload, part: str, engine: str, config: str, settings: dict, run, transformer, steps: int,
                 stats=None, **extra) -> dict:
    """A whole-request row: forwards counted over the warm-up request (whose output is compared with eager), then
    timed requests, as a ratio to eager; ``stats()`` adds what the engine itself reports."""
    eager = wl.eager_request(steps)
    with counting(transformer) as count, torch.no_grad():
        latents = run(steps)
    med, samples = harness.per_request(run, steps, wl.repeats)
    return emit({"part": part, "workload": wl.name, "engine": engine, "config": config, "settings": settings,
                 "steps": steps, "request_s": med, "samples_s": samples, **_ratios(med, eager["request_s"]),
                 "forwards": count.summary(), "eager_forwards": eager["forwards"],
                 "latent_cosine_vs_eager": harness.cosine(latents, eager["latents"]), **extra,
                 **(stats() if stats else {})})


def _cachedit_stats(pipe) -> dict:
    try:
        stats = _peer("cache_dit").summary(pipe, logging=False)
        return {"cached_steps": [list(s.cached_steps) for s in stats],
                "cfg_cached_steps": [list(s.cfg_cached_steps) for s in stats]}
    except Exception as exc:  # noqa: BLE001 - stats are a bonus
        return {"stats_error": str(exc)[:200]}


def _cachedit_cached(wl: Workload, config) -> tuple:
    """A cache-dit pipeline (own class) over a copy of the denoiser, with ``config`` applied."""
    cache_dit = _peer("cache_dit")
    twin = _twin(wl)
    pipe = diffusers_pipeline(wl.name, wl.mods, twin, cls=clean_class(wl.name))
    cache_dit.enable_cache(pipe, cache_config=config)
    return pipe, twin


def default_mask(steps: int, policy: str) -> tuple[list[int], str]:
    try:
        cache_dit = _peer("cache_dit")
    except RuntimeError:
        # without cache-dit: compute the first quarter, then every other step, and the last step
        mask = [1 if i < max(1, steps // 4) or i % 2 == 0 or i == steps - 1 else 0 for i in range(steps)]
        return mask, "omnispec benchmark's own (cache-dit not installed)"
    return list(cache_dit.steps_mask(total_steps=steps, mask_policy=policy)), \
        f"cache_dit.steps_mask(total_steps={steps}, mask_policy={policy!r})"


def step_mask_part(wl: Workload, args) -> None:
    name, steps = wl.name, wl.w["cache_steps"]
    wl.eager_request(steps)  # on the untouched modules, before any cache is built
    mask, source = default_mask(steps, args.mask_policy)
    common = {"mask": "".join(map(str, mask)), "mask_source": source, "computed_steps": sum(mask)}
    try:
        from cache_dit import DBCacheConfig

        config = DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=0,
                               steps_computation_mask=mask, steps_computation_policy="static",
                               num_inference_steps=steps)
        pipe, twin = _cachedit_cached(wl, config)
        settings = {**common, "call": "cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))",
                    "cache_config": config.strify(),
                    "note": "masked steps still run the Fn first blocks, embedders and output layers"}
        _request_row(wl, "step_mask", "cache-dit", "steps_computation_mask (static)", settings,
                     diffusers_runner(pipe, name), twin, steps, stats=lambda: _cachedit_stats(pipe))
    except Exception as exc:  # noqa: BLE001
        error_row("step_mask", name, "cache-dit", "steps_computation_mask (static)", exc, settings=common)
    pipe = twin = None
    harness.free_device_memory()
    bools = ", ".join("true" if m else "false" for m in mask)
    try:
        pipe = omnispec_pipeline(name, wl.mods, [f"policies.cache={{kind: step_mask, mask: [{bools}]}}"])
        _request_row(wl, "step_mask", "omnispec", "cache: step_mask",
                     {**common, "spec": "policies.cache={kind: step_mask, mask: [...]}", "attention": "sdpa",
                      "note": "masked steps reuse the last guided prediction: no denoiser call"},
                     omnispec_runner(pipe, name), wl.mods["transformer"], steps)
    except Exception as exc:  # noqa: BLE001
        error_row("step_mask", name, "omnispec", "cache: step_mask", exc, settings=common)
    pipe = None
    wl.reset_modules()


def _parse_dbcache(text: str) -> tuple[int, int, int]:
    import re

    m = re.fullmatch(r"F(\d+)B(\d+)W(\d+)", text.strip())
    if m is None:
        raise SystemExit(f"--dbcache {text!r}: expected F<n>B<n>W<n>, e.g. F1B0W0")
    return int(m[1]), int(m[2]), int(m[3])


def match_threshold(count_at, target: int, start: float, probes: int) -> tuple[float, dict[float, int]]:
    """The threshold whose run gives ``target`` full forwards (forwards fall as the threshold grows): geometric
    bracketing from ``start``, then bisection in log space, at most ``probes`` runs; the closest count wins."""
    tried: dict[float, int] = {}
    lo = hi = None
    t = start
    for _ in range(probes):
        k = tried[t] = count_at(t)
        if k == target:
            break
        if k > target:
            lo = t if lo is None else max(lo, t)
        else:
            hi = t if hi is None else min(hi, t)
        t = math.sqrt(lo * hi) if lo is not None and hi is not None else (lo * 4 if lo is not None else hi / 4)
    best = min(tried, key=lambda x: (abs(tried[x] - target), x))
    return best, tried


def dbcache_part(wl: Workload, args) -> None:
    name, steps = wl.name, wl.w["cache_steps"]
    wl.eager_request(steps)  # on the untouched modules, before any cache is built
    for spec_text in args.dbcache.split(","):
        fn, bn, warm = _parse_dbcache(spec_text)
        for threshold in (float(t) for t in args.dbcache_threshold.split(",")):
            label = f"DBCache F{fn}B{bn}W{warm} R{threshold}"
            try:
                from cache_dit import DBCacheConfig

                config = DBCacheConfig(Fn_compute_blocks=fn, Bn_compute_blocks=bn, max_warmup_steps=warm,
                                       residual_diff_threshold=threshold, num_inference_steps=steps)
                pipe, twin = _cachedit_cached(wl, config)
                row = _request_row(wl, "dbcache", "cache-dit", label,
                                   {"call": "cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))",
                                    "cache_config": config.strify()}, diffusers_runner(pipe, name), twin, steps,
                                   stats=lambda p=pipe: _cachedit_stats(p))
                target = row["forwards"]["full_forwards"]
            except Exception as exc:  # noqa: BLE001
                error_row("dbcache", name, "cache-dit", label, exc)
                target = None
            pipe = twin = None
            harness.free_device_memory()
            if target is None:
                continue

            def count_at(t: float) -> int:
                pipe = omnispec_pipeline(name, wl.mods, [f"policies.cache={{kind: first_block, threshold: {t:.6g}}}"])
                with counting(wl.mods["transformer"]) as count, torch.no_grad():
                    omnispec_runner(pipe, name)(steps)
                return count.last

            config_label = f"cache: first_block (matched to {label})"
            try:
                best, tried = match_threshold(count_at, target, threshold, args.search_probes)
                pipe = omnispec_pipeline(name, wl.mods, [f"policies.cache={{kind: first_block, threshold: {best:.6g}}}"])
                _request_row(wl, "dbcache", "omnispec", config_label,
                             {"spec": f"policies.cache={{kind: first_block, threshold: {best:.6g}}}", "attention": "sdpa",
                              "threshold_search": {f"{t:.6g}": k for t, k in tried.items()},
                              "target_full_forwards": target}, omnispec_runner(pipe, name), wl.mods["transformer"],
                             steps, matched=tried[best] == target)
            except Exception as exc:  # noqa: BLE001
                error_row("dbcache", name, "omnispec", config_label, exc)
            pipe = None
            wl.reset_modules()


# ---- part: fp8 --------------------------------------------------------------------------------------------------

def _quantized_linears(module: torch.nn.Module) -> dict:
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in linears if type(m.weight.data) is not torch.Tensor]
    return {"linears": len(linears), "quantized_linears": len(quantized),
            "weight_types": sorted({type(m.weight.data).__name__ for m in quantized})}


def fp8_part(wl: Workload, args) -> None:
    name = wl.name
    wl.eager_step()  # the bf16 eager row, and the first denoiser output every fp8 row is compared with
    cuda = harness.DEVICE == "cuda"
    method = "fp8_dynamic" if cuda else "int8_weight_only"  # --smoke: a method the CPU runs
    policy, _ = harness.quantized_transformer(method, "row" if cuda else None)
    original = wl.mods["transformer"]
    original.to("cpu")  # the bf16 original waits on the host: the peaks below are the quantized copies' own
    harness.free_device_memory()
    modes = (["none"] if args.fp8_eager else []) + ["regional"]
    engines = args.fp8_engines.split(",")
    for mode in modes if "omnispec" in engines else ():  # omnispec first: cache-dit's patches torchao process-wide
        label = f"{method}{' + compile: regional' if mode == 'regional' else ' eager'}"
        try:
            twin = plain_copy(original)
            pipe = omnispec_pipeline(name, {**wl.mods, "transformer": twin}, [policy, f"policies.compile.mode={mode}"])
            _step_row(wl, "fp8", "omnispec", label,
                      {"spec": [policy, f"policies.compile.mode={mode}"], **_quantized_linears(twin)},
                      omnispec_runner(pipe, name), twin)
        except Exception as exc:  # noqa: BLE001
            error_row("fp8", name, "omnispec", label, exc)
        pipe = twin = None
        harness.free_device_memory()
        torch._dynamo.reset()
    for mode in modes if "cache-dit" in engines else ():
        label = "float8_per_row" + (" + compile path" if mode == "regional" else " eager")
        with process_wide_compile_settings():
            try:
                cache_dit = _peer("cache_dit")
                from cache_dit import QuantizeConfig

                twin = plain_copy(original).to(harness.DEVICE)
                config = QuantizeConfig(quant_type="float8_per_row")
                twin = cache_dit.quantize(twin, quantize_config=config)
                how = cachedit_compile(twin) if mode == "regional" else {}
                _step_row(wl, "fp8", "cache-dit", label,
                          {"call": "cache_dit.quantize(transformer, QuantizeConfig(quant_type='float8_per_row'))",
                           "exclude_layers": config.exclude_layers, "regional_quantize": config.regional_quantize,
                           **how, **_quantized_linears(twin)},
                          diffusers_runner(diffusers_pipeline(name, wl.mods, twin), name), twin)
            except Exception as exc:  # noqa: BLE001
                error_row("fp8", name, "cache-dit", label, exc)
            twin = None
            harness.free_device_memory()
            torch._dynamo.reset()
    original.to(harness.DEVICE)


# ---- part: model offload, a new prompt per request ----------------------------------------------------------

def transfer_profile(run) -> dict:
    """One request under torch.profiler: host<->device copies by kind (the driver names pageable and pinned
    sources), their bytes, GPU time and bandwidth, and bursts of them in time from the request's start."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if harness.DEVICE == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        harness.sync()
        start = time.perf_counter()
        with torch.no_grad():
            run()
        harness.sync()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    timed = [e for e in events if isinstance(e, dict) and "ts" in e and e.get("ph") == "X"]
    t0 = min((float(e["ts"]) for e in timed), default=0.0)
    copies = sorted((e for e in timed if e.get("cat") == "gpu_memcpy"), key=lambda e: float(e["ts"]))
    kernels = [e for e in timed if e.get("cat") == "kernel"]
    kinds: dict[str, dict] = {}
    for e in copies:
        k = kinds.setdefault(e["name"], {"count": 0, "gib": 0.0, "gpu_ms": 0.0})
        k["count"] += 1
        k["gib"] += float(e.get("args", {}).get("bytes", 0)) / 2**30
        k["gpu_ms"] += float(e.get("dur", 0)) / 1e3
    for k in kinds.values():
        k["gib_per_s"] = k["gib"] / (k["gpu_ms"] / 1e3) if k["gpu_ms"] else None
    bursts: list[dict] = []
    for e in copies:  # consecutive copies of one kind less than 5 ms apart are one burst
        ts, end = (float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e.get("dur", 0)) - t0) / 1e3
        gib = float(e.get("args", {}).get("bytes", 0)) / 2**30
        if bursts and bursts[-1]["kind"] == e["name"] and ts - bursts[-1]["to_ms"] < 5.0:
            bursts[-1].update(to_ms=end, copies=bursts[-1]["copies"] + 1, gib=bursts[-1]["gib"] + gib)
        else:
            bursts.append({"kind": e["name"], "from_ms": ts, "to_ms": end, "copies": 1, "gib": gib})
    compute = ({"first_kernel_ms": (min(float(e["ts"]) for e in kernels) - t0) / 1e3,
                "last_kernel_ms": (max(float(e["ts"]) + float(e.get("dur", 0)) for e in kernels) - t0) / 1e3,
                "kernel_gpu_ms": sum(float(e.get("dur", 0)) for e in kernels) / 1e3} if kernels else {})
    return {"wall_s": wall, "copies_by_kind": kinds, "bursts": bursts[:16], "bursts_total": len(bursts), **compute}


def _host_memory() -> dict:
    """This process's resident host memory and, on CUDA, the page-locked memory torch's host allocator holds
    (it rounds blocks up to powers of two, so it can exceed the bytes pinned)."""
    out = {}
    try:
        import psutil

        out["rss_gib"] = psutil.Process().memory_info().rss / 2**30
    except ImportError:
        pass
    if harness.DEVICE == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        for key in ("allocated_bytes.current", "reserved_bytes.current"):
            if key in stats:
                out[f"pinned_{key.split('.')[0]}_gib"] = stats[key] / 2**30
    return out


def offload_part(wl: Workload, args) -> None:
    """omnispec ``offload: model`` against diffusers' ``enable_model_cpu_offload``, whole requests with a new
    prompt each time (the encoders run, so the denoiser leaves the device and comes back). Each side has its own
    copy of the modules, so neither carries the other's hooks and their requests alternate (host memory that
    a first move has to grow then costs both sides alike)."""
    name, steps, repeats = wl.name, args.offload_steps, wl.repeats
    resident = omnispec_pipeline(name, wl.mods, [])
    run_resident = omnispec_runner(resident, name, fresh=True)
    with torch.no_grad():
        run_resident(steps)
    med, samples = harness.per_request(run_resident, steps, repeats)
    eager_resident = med
    emit({"part": "offload", "workload": name, "engine": "omnispec", "config": "resident (no offload)",
          "settings": {"spec": "policies.offload={strategy: none}", "prompt": "new each request", "steps": steps},
          "request_s": med, "samples_s": samples, "peak_gib": _peak_gib(run_resident, steps)})
    resident = run_resident = None
    for m in wl.mods.values():
        if isinstance(m, torch.nn.Module):
            m.to("cpu")
    harness.free_device_memory()
    peer_mods = {k: copy.deepcopy(v) if isinstance(v, torch.nn.Module) or hasattr(v, "set_timesteps") else v
                 for k, v in wl.mods.items()}  # modules and the (stateful) scheduler; tokenizers are shared
    sides = {}
    try:
        pipe = omnispec_pipeline(name, wl.mods, ["policies.offload={strategy: model}"])
        sides["omnispec"] = ("offload: model", omnispec_runner(pipe, name, fresh=True),
                             {"spec": "policies.offload={strategy: model}", "explain": pipe.explain(as_dict=True).get("applied", {}).get("offload")})
    except Exception as exc:  # noqa: BLE001
        error_row("offload", name, "omnispec", "offload: model", exc)
    try:
        peer = diffusers_pipeline(name, peer_mods)
        peer.enable_model_cpu_offload(device=harness.DEVICE)
        sides["diffusers"] = ("enable_model_cpu_offload", diffusers_runner(peer, name, fresh=True),
                              {"call": f"pipe.enable_model_cpu_offload(device={harness.DEVICE!r})",
                               "offload_seq": peer.model_cpu_offload_seq})
    except Exception as exc:  # noqa: BLE001
        error_row("offload", name, "diffusers", "enable_model_cpu_offload", exc)
    samples: dict[str, list[float]] = {k: [] for k in sides}
    for engine, (_, run, _) in sides.items():  # warm-up: first moves, pinning, allocator growth
        with torch.no_grad():
            run(steps)
    for _ in range(repeats):  # alternate, so drift and host-memory state reach both sides
        for engine, (_, run, _) in sides.items():
            samples[engine] += harness.per_request(run, steps, 1)[1]
    diffusers_s = statistics.median(samples["diffusers"]) if samples.get("diffusers") else None
    for engine, (config, run, settings) in sides.items():
        med = statistics.median(samples[engine])
        row = {"part": "offload", "workload": name, "engine": engine, "config": config,
               "settings": {**settings, "prompt": "new each request", "steps": steps}, "request_s": med,
               "samples_s": samples[engine], "time_ratio_vs_resident": med / eager_resident,
               "peak_gib": _peak_gib(run, steps), "host_memory_after": _host_memory()}
        if diffusers_s and engine != "diffusers":
            row["time_ratio_vs_diffusers_offload"] = med / diffusers_s
        try:
            row["transfers"] = transfer_profile(lambda r=run: r(steps))
        except Exception as exc:  # noqa: BLE001
            row["transfers"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        emit(row)
    if "omnispec" in sides:  # the same prompt again: omnispec's prompt-embedding cache skips the encoders
        run_same = omnispec_runner(pipe, name)
        with torch.no_grad():
            run_same(steps)
        med, samples_same = harness.per_request(run_same, steps, repeats)
        emit({"part": "offload", "workload": name, "engine": "omnispec", "config": "offload: model, same prompt",
              "settings": {"spec": "policies.offload={strategy: model}", "prompt": "the same each request",
                           "steps": steps}, "request_s": med, "samples_s": samples_same,
              "time_ratio_vs_resident": med / eager_resident})


PARTS = {"compile": compile_part, "step_mask": step_mask_part, "dbcache": dbcache_part, "fp8": fp8_part,
         "offload": offload_part}


# ---- two GPUs ---------------------------------------------------------------------------------------------------

PARALLEL_CONFIGS = ["omnispec single", "omnispec cfg2", "omnispec ulysses2", "diffusers ulysses2",
                    "cache-dit ulysses2", "cache-dit ulysses2 async", "cache-dit cfg2", "xDiT ulysses2", "xDiT cfg2"]
UNSUPPORTED = {
    "cache-dit cfg2": "not offered: cache-dit 1.5.3's ParallelismConfig has ulysses_size, ring_size and tp_size only "
                      "(no CFG parallelism anywhere in the package)",
    "xDiT cfg2": "not supported for these models by xfuser 0.7.0: the FLUX.1-dev and Wan2.1-T2V runners' "
                 "ModelCapabilities leave use_cfg_parallel False (FLUX.1-dev has no CFG pass; xFuserFluxPipeline's "
                 "__call__ is wrapped with cfg_parallel_available=False), and diffusers' WanPipeline runs cond and "
                 "uncond as separate forwards that xFuserWanTransformer3DWrapper does not split",
}


def _parallel_extra(name: str) -> dict:
    """FLUX under --parallel: true CFG 4 with a negative prompt on every side (two passes to split)."""
    return {"true_cfg_scale": 4.0, "negative_prompt": "blurry"} if name == "flux" else {}


def _parallel_row(name: str, config: str, settings: dict, run, baseline: dict, repeats: int, **extra) -> dict:
    lo, hi = WORK[name]["parallel_steps"]
    with torch.no_grad():
        run(lo)
        med, samples = _per_step(run, lo, hi, repeats)
        latents = run(lo)
    row = {"part": "parallel", "workload": name, "engine": config.split()[0], "config": config, "settings": settings,
           "ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], **extra}
    if baseline:
        row |= _ratios(med * 1e3, baseline["ms_per_step"]) | {
            "latent_cosine_vs_eager": harness.cosine(latents, baseline["latents"])}
    return row


def _omnispec_parallel(name: str, config: str, repeats: int, baseline: dict) -> dict | None:
    import torch.distributed as dist

    label = {"omnispec single": "single", "omnispec cfg2": "cfg2", "omnispec ulysses2": "ulysses2"}[config]
    if label == "single" and dist.get_rank() != 0:
        return None
    mods = components(name)
    overrides = [o for o in parallel_overrides(name, label) if o != "runtime.progress=false"]
    pipe = omnispec_pipeline(name, mods, overrides)
    extra = {"negative_prompt": "blurry"} if name == "flux" else {}
    return _parallel_row(name, config, {"spec": overrides}, omnispec_runner(pipe, name, extra), baseline, repeats)


def _diffusers_ulysses(name: str, repeats: int, baseline: dict) -> dict:
    from diffusers import ContextParallelConfig

    mods = components(name)
    mods["transformer"].enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    run = diffusers_runner(diffusers_pipeline(name, mods), name, _parallel_extra(name))
    return _parallel_row(name, "diffusers ulysses2", {"call": "transformer.enable_parallelism("
                                                      "config=ContextParallelConfig(ulysses_degree=2))"},
                         run, baseline, repeats)


def _cachedit_ulysses(name: str, config: str, repeats: int, baseline: dict) -> dict:
    cache_dit = _peer("cache_dit")
    from cache_dit import ParallelismConfig

    mods = components(name)
    pipe = diffusers_pipeline(name, mods, cls=clean_class(name))
    parallel = ParallelismConfig(ulysses_size=2, ulysses_async=config.endswith("async"))
    cache_dit.enable_cache(pipe, parallelism_config=parallel)
    settings = {"call": "cache_dit.enable_cache(pipe, parallelism_config=ParallelismConfig(ulysses_size=2"
                        + (", ulysses_async=True))" if parallel.ulysses_async else "))"),
                "backend": str(parallel.backend), "attention_backend": parallel.attention_backend or "native (its default under CP)"}
    return _parallel_row(name, config, settings, diffusers_runner(pipe, name, _parallel_extra(name)), baseline, repeats)


def _xfuser_on_cpu() -> None:
    """``--smoke`` only. xfuser refuses to import without an accelerator (its ``envs`` asks for a CUDA version
    and picks NCCL), tells its config that yunchang is missing off CUDA, and reaches its Ulysses group through
    yunchang only on CUDA. Loading its ``envs`` first with CPU answers (gloo) lets the same wiring as on the GPUs
    run here; it still needs triton importable (xfuser imports it unconditionally)."""
    import importlib.util
    import sys
    import types

    if "xfuser" in sys.modules or importlib.util.find_spec("xfuser") is None:
        return
    root = next(iter(importlib.util.find_spec("xfuser").submodule_search_locations))
    sys.modules["xfuser"] = types.ModuleType("xfuser")
    sys.modules["xfuser"].__path__ = [root]
    try:
        spec = importlib.util.spec_from_file_location("xfuser.envs", os.path.join(root, "envs.py"))
        envs = sys.modules["xfuser.envs"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(envs)
        envs.get_device_version = lambda: "12.8"
        envs.get_torch_distributed_backend = lambda: "gloo"
        envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] = True
    finally:
        del sys.modules["xfuser"]


def _xdit_ulysses(name: str, repeats: int, baseline: dict, attention: str = "") -> dict:
    """xDiT's Ulysses 2 as its runner sets it up, around the same tensors."""
    if harness.SMOKE:
        _xfuser_on_cpu()
    _peer("xfuser")
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import get_runtime_state, init_distributed_environment, initialize_runtime_state
    from xfuser.core.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized

    if harness.SMOKE:  # yunchang's groups are what xDiT's Ulysses all-to-all uses; on CUDA xfuser takes them itself
        import yunchang.globals
        from xfuser.model_executor.layers import usp

        usp.PROCESS_GROUP = yunchang.globals.PROCESS_GROUP
        attention = attention or "SDPA"  # its CUDNN default needs CUDA

    w = WORK[name]
    init_distributed_environment()  # the process group exists: this only makes xDiT's world group
    if model_parallel_is_initialized():
        destroy_model_parallel()
    fields = {"model": w["xdit_model"], "ulysses_degree": 2, "ring_degree": 1, "use_cfg_parallel": False,
              "height": w["diffusers"]["height"], "width": w["diffusers"]["width"],
              "num_inference_steps": w["parallel_steps"][1], "max_sequence_length": w["diffusers"]["max_sequence_length"]}
    if name == "wan":
        fields["num_frames"] = w["diffusers"]["num_frames"]
    if attention:
        fields["attention_backend"] = attention
    xargs = xFuserArgs(**fields)
    engine_config, _ = xargs.create_config()
    mods = components(name)
    original = mods["transformer"]
    if name == "flux":
        from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper as cls
        init = {}
    else:
        from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs
        from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanTransformer3DWrapper as cls
        init = {"attention_kwargs": _build_attention_kwargs(xargs)}
    params = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in dict(original.config).items() if k in params}
    with torch.device(harness.DEVICE):
        twin = cls(**config, **init).to(original.dtype)
    twin.load_state_dict(original.state_dict(), assign=True)  # the same tensors
    mods["transformer"], original = twin.eval(), None
    pipe = diffusers_pipeline(name, mods)
    initialize_runtime_state(pipe, engine_config)
    state = get_runtime_state()

    def before(n: int) -> None:
        if name == "flux":
            state.set_input_parameters(height=w["diffusers"]["height"], width=w["diffusers"]["width"], batch_size=1,
                                       num_inference_steps=n, max_condition_sequence_length=w["diffusers"]["max_sequence_length"],
                                       split_text_embed_in_sp=True)
        else:
            state.reset_vsa_schedule_state(n)

    settings = {"setup": f"xFuserArgs({fields}).create_config(); initialize_runtime_state(pipe, engine_config)",
                "transformer": cls.__name__, "pipeline": type(pipe).__name__,
                "attention_backend": getattr(state.attention_backend, "name", str(state.attention_backend))}
    try:
        return _parallel_row(name, "xDiT ulysses2", settings, diffusers_runner(pipe, name, _parallel_extra(name),
                                                                               before=before), baseline, repeats)
    finally:
        destroy_model_parallel()


def _attention_impl() -> str:
    """Where diffusers' native attention backend comes from now (cache-dit's parallelism replaces it)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    fn = _AttentionBackendRegistry._backends.get(AttentionBackendName.NATIVE)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _parallel_config(name: str, config: str, repeats: int, baseline: dict, args) -> dict | None:
    if config.startswith("omnispec"):
        return _omnispec_parallel(name, config, repeats, baseline)
    if config == "diffusers ulysses2":
        return _diffusers_ulysses(name, repeats, baseline)
    if config.startswith("cache-dit"):
        return _cachedit_ulysses(name, config, repeats, baseline)
    if config == "xDiT ulysses2":
        return _xdit_ulysses(name, repeats, baseline, args.xdit_attention)
    raise SystemExit(f"unknown --parallel-configs entry {config!r}; known: {PARALLEL_CONFIGS}")


def parallel_main(args) -> bool:
    """The two-GPU rows. cache-dit's parallelism re-registers diffusers' attention backends process-wide with
    its own (``_register_cache_dit_attn_backends_to_diffusers``; omnispec's and diffusers' context parallelism
    dispatch through that registry), and xfuser keeps process-wide groups: so every omnispec and diffusers row
    of every workload runs first, then cache-dit's, then xDiT's. Returns whether this is rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo" if args.smoke else "nccl")
    if not args.smoke:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.get_world_size() != 2:
        raise SystemExit("--parallel needs exactly two processes (torchrun --nproc-per-node 2)")
    rank = dist.get_rank()
    configs = args.parallel_configs.split(",")
    unknown = [c for c in configs if c not in PARALLEL_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --parallel-configs entries {unknown}; known: {PARALLEL_CONFIGS}")
    workloads = args.workloads.split(",")
    baselines: dict[str, dict] = {name: {} for name in workloads}
    for name in workloads:
        mods = components(name)  # on every rank: the tokenizers are made once, on rank 0, for all
        if rank == 0:  # diffusers' single-GPU eager run: the reference of every row
            try:
                run = diffusers_runner(diffusers_pipeline(name, mods), name, _parallel_extra(name))
                row = _parallel_row(name, "diffusers single (eager)", {"extra": _parallel_extra(name)}, run, {},
                                    args.repeats)
                with torch.no_grad():
                    baselines[name] = {"ms_per_step": row["ms_per_step"],
                                       "latents": run(WORK[name]["parallel_steps"][0]).float().cpu()}
                emit(row)
            except Exception as exc:  # noqa: BLE001
                error_row("parallel", name, "diffusers", "diffusers single (eager)", exc)
        mods = run = None
        harness.free_device_memory()
        dist.barrier()
    phases = ([c for c in configs if c.split()[0] in ("omnispec", "diffusers")],
              [c for c in configs if c.startswith("cache-dit")], [c for c in configs if c.startswith("xDiT")])
    for phase in phases:
        for name in workloads:
            for config in phase:
                if config in UNSUPPORTED:
                    error_row("parallel", name, config.split()[0], config, UNSUPPORTED[config], not_run=True)
                    continue
                try:
                    row = _parallel_config(name, config, args.repeats, baselines[name], args)
                    if row is not None:
                        emit(row | {"diffusers_native_attention": _attention_impl()})
                except SystemExit:
                    raise
                except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                    error_row("parallel", name, config.split()[0], config, exc)
                harness.free_device_memory()
                dist.barrier()
    dist.destroy_process_group()
    return rank == 0


# ---- main -------------------------------------------------------------------------------------------------------

def table() -> None:
    print("| part | workload | engine | config | time | vs eager | forwards (full / block units) | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in RESULTS.rows:
        if "error" in r:
            print(f"| {r['part']} | {r['workload']} | {r['engine']} | {r['config']} | | | | "
                  f"{'not run' if r.get('not_run') else 'error'}: {r['error'][:90]} |")
            continue
        if "ms_per_step" in r:
            t = f"{r['ms_per_step']:.1f} ms/step"
        elif "request_s" in r:
            t = f"{r['request_s']:.2f} s/request"
        else:
            t = ""
        ratio = (f"{r['speedup_vs_eager']:.2f}x" if "speedup_vs_eager" in r
                 else f"{r['time_ratio_vs_resident']:.2f}x time vs resident" if "time_ratio_vs_resident" in r else "")
        f = r.get("forwards")
        fw = f"{f['full_forwards']} / {f['block_computes_in_full_forwards']}" if f else ""
        note = ""
        if "second_over_first" in r:
            note = f"second / first {r['second_over_first']:.3f} (median of {r['rounds']} interleaved rounds)"
        elif "time_ratio_vs_diffusers_offload" in r:
            note = f"{r['time_ratio_vs_diffusers_offload']:.2f}x diffusers' offload"
        elif "denoiser_cosine_vs_eager" in r:
            note = f"cos {r['denoiser_cosine_vs_eager']:.5f}"
        elif "latent_cosine_vs_eager" in r:
            note = f"latent cos {r['latent_cosine_vs_eager']:.5f}"
        print(f"| {r['part']} | {r['workload']} | {r['engine']} {r.get('version') or ''} | {r['config']} | {t} | "
              f"{ratio} | {fw} | {note} |")


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default="flux,wan")
    parser.add_argument("--parts", default="compile,step_mask,dbcache,fp8,offload")
    parser.add_argument("--parallel", action="store_true", help="the two-GPU rows (under torchrun, 2 processes)")
    parser.add_argument("--parallel-configs", default=",".join(PARALLEL_CONFIGS))
    parser.add_argument("--xdit-attention", default="",
                        help="xDiT attention backend (AttentionBackendType name, e.g. SDPA); default: xDiT's choice")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-steps", default="", help="e.g. flux=28,wan=8: request steps of the caching parts")
    parser.add_argument("--mask-policy", default="medium", help="cache_dit.steps_mask policy: slow|medium|fast|ultra")
    parser.add_argument("--dbcache", default="F1B0W0", help="cache-dit DBCache shapes, e.g. F1B0W0,F8B0W8 (its default)")
    parser.add_argument("--dbcache-threshold", default="0.08", help="cache-dit residual_diff_threshold(s)")
    parser.add_argument("--search-probes", type=int, default=7, help="omnispec threshold runs per matched row")
    parser.add_argument("--fp8-eager", action="store_true", help="also the eager fp8 rows (slow, unfused)")
    parser.add_argument("--fp8-engines", default="omnispec,cache-dit",
                        help="whose fp8 rows the fp8 part times (cache-dit alone gives its long compile the call)")
    parser.add_argument("--omnispec-compile", default="regional",
                        help="omnispec's rows of the compile part, comma-separated, as gpu_policies' "
                             "--compile-variants (e.g. regional,regional+cudagraphs+qk_norm_rope+fused_gelu)")
    parser.add_argument("--compile-rounds", type=int, default=0, metavar="N",
                        help="then N interleaved rounds (ABBA) of the first omnispec row against cache-dit's, both "
                             "kept built: a paired ratio per round")
    parser.add_argument("--compile-extra", action="store_true",
                        help="also omnispec regional compile under cache-dit's inductor settings")
    parser.add_argument("--offload-steps", type=int, default=4)
    parser.add_argument("--offload-workloads", default="flux", help="workloads the offload part runs on")


def benchmark(args, results: harness.Results) -> None:
    global RESULTS
    RESULTS = results
    for item in filter(None, args.cache_steps.split(",")):
        key, value = item.split("=")
        WORK[key]["cache_steps"] = int(value)
    VERSIONS.update(versions())
    results.header["versions"] = VERSIONS
    harness.show({"versions": VERSIONS, "device": harness.device_name()})
    main_rank = True
    if args.parallel:
        main_rank = parallel_main(args)
    else:
        ceiling = harness.matmul_ceiling()
        for name in args.workloads.split(","):
            try:
                wl = Workload(name, args.repeats, ceiling)
            except Exception as exc:  # noqa: BLE001
                error_row("setup", name, "diffusers", "components", exc)
                continue
            for part in args.parts.split(","):
                if part == "offload" and name not in args.offload_workloads.split(","):
                    continue  # the per-request offload figure in question is FLUX's
                try:
                    PARTS[part](wl, args)
                except Exception as exc:  # noqa: BLE001 - keep the other parts' rows
                    error_row(part, name, "-", "part", exc)
                harness.free_device_memory()
            wl = None
            harness.free_device_memory()
    if main_rank:
        table()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="tiny modules on the CPU (checks the script only)")


if __name__ == "__main__":
    main()
