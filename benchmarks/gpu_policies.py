"""Policies at real sizes (random bf16 weights): per-step time, peak memory and MFU against the plain eager run.
Peer: omnispec's own eager run measured in the same call, and diffusers' own call for the policy where it has one
(``set_attention_backend``, ``compile_repeated_blocks``, torchao ``quantize_``, ``enable_model_cpu_offload``,
``enable_group_offload``).

``python -m benchmarks.gpu_policies [--parts attention,compile,quant,model_offload,wan_attention,layerwise]
[--json FILE]``

- attention (FLUX.1-dev 1024²): every usable backend, omnispec ``auto``, and diffusers' ``set_attention_backend``.
- compile (FLUX.1-dev 1024²): omnispec ``compile: regional`` and diffusers' ``compile_repeated_blocks``;
  compile time reported separately.
- quant (FLUX.1-dev 1024²): ``quantization: fp8_dynamic`` eager and with regional compile, against bf16 eager;
  cosine of the first denoiser output against bf16; peer: torchao ``quantize_`` with the same config and
  ``compile_repeated_blocks`` on the diffusers pipeline.
- fp8_block (one FLUX.1-dev single-stream block at 1024²): bf16 and fp8 per tensor / per row, eager and
  compiled, ms per call, and the fp8 eager call's top CUDA kernels.
- model_offload (FLUX.1-dev 1024²): peak memory, per-step and per-request (4 steps) time of ``offload: model``;
  peer ``enable_model_cpu_offload``.
- wan_attention (Wan 14B attention shapes at 480x832x81, CFG; 8 of the 40 blocks, since only the ratio between
  backends is asked): every usable backend and ``auto``.
- layerwise (Wan 14B 480x832x81, CFG): ``offload: layerwise`` vs resident, and diffusers' ``enable_group_offload``.
- profile (FLUX.1-dev 1024², not in the default parts): eager and each ``--compile-variants`` configuration under
  torch.profiler: device time per step by kernel kind (attention, matmul, inductor's fused kernels, copies, other),
  the largest kernels, and the wall time per step beside the device's busy time.
Per-step time = (time of N_hi steps - N_lo steps) / (N_hi - N_lo), latents not decoded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import statistics
import time
from pathlib import Path

import torch

from . import harness, inductor_passes
from .harness import compile_overrides
from .workloads import WORKLOADS, flux_components, plain_copy, wan_components


def _build(spec: str, mods: dict, overrides: list[str]):
    import omnispec

    return omnispec.build(harness.ROOT / "specs" / spec, components=mods, device=harness.DEVICE,
                          overrides=["runtime.progress=false", *overrides])


_TAKES = itertools.count()


def _prompt(fresh: bool) -> str:
    """The benchmark prompt; ``fresh`` makes it new on every call, so no prompt-embedding cache can hit."""
    return f"a photo of a cat, take {next(_TAKES)}" if fresh else "a photo of a cat"


def _runner(pipe, request: dict, fresh: bool = False):
    from omnispec.spec.request import resolve_request

    def run(n: int):
        pipe.generate(resolve_request(pipe.spec, _prompt(fresh), 0, steps=n, **request), decode=False)

    return run


def _peak(run, n: int) -> float:
    if harness.DEVICE != "cuda":
        return 0.0
    harness.sync()
    torch.cuda.reset_peak_memory_stats()
    run(n)
    harness.sync()
    return torch.cuda.max_memory_allocated() / 2**30


def _release(mods: dict, names: tuple[str, ...] | None = None) -> None:
    """Move modules (all, or ``names``) back to the host and free the device cache for the next build."""
    for name, m in mods.items():
        if isinstance(m, torch.nn.Module) and (names is None or name in names):
            m.to("cpu")
    harness.free_device_memory()




def _diffusers_runner(pipeline, w: dict, fresh: bool = False):
    pipeline.set_progress_bar_config(disable=True)

    def run(n: int):
        pipeline(_prompt(fresh), num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                 output_type="latent", **w["diffusers_kwargs"])

    return run


def _flux_plain(part: str, label: str, repeats: int, ceiling: float):
    """Random FLUX.1-dev-size components, the plain omnispec run over them, its FLOPs per step and its row."""
    mods = flux_components()
    w = WORKLOADS["flux"]
    run_plain = _runner(_build(w["spec"], mods, []), w["request"])
    flops = harness.flops_per_step(run_plain)
    row = {"part": part, "config": label, **_measure(run_plain, 2, 4, repeats, flops, ceiling)}
    return mods, w, run_plain, flops, row


def _measure(run, lo, hi, repeats, flops, ceiling) -> dict:
    if harness.SMOKE:  # --smoke: the fewest steps that still give a per-step difference
        lo, hi = 1, 2
    with torch.no_grad():
        run(lo)  # warm-up (and lazy compilation)
        queued: list[float] = []
        med, samples = harness.per_step(run, lo, hi, repeats, queued)
    return {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "mfu": flops / med / ceiling,
            "queued_ms_at_return": statistics.median(queued) * 1e3, "peak_gib": _peak(run, lo)}


def attention_part(repeats: int, ceiling: float, save) -> None:
    mods = flux_components()
    w = WORKLOADS["flux"]
    plain = _build(w["spec"], mods, ["policies.attention.default=sdpa"])
    flops = harness.flops_per_step(_runner(plain, w["request"]))
    for backend in ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sage", "auto"):
        try:
            pipe = _build(w["spec"], mods, [f"policies.attention.default={backend}"])
        except Exception as exc:  # noqa: BLE001 - an unusable backend is a result, not a crash
            save({"part": "attention", "config": backend, "error": str(exc).splitlines()[0]})
            continue
        row = {"part": "attention", "config": backend,
               **_measure(_runner(pipe, w["request"]), 2, 4, repeats, flops, ceiling)}
        if backend == "auto":
            row["explain"] = pipe.explain(as_dict=True)["attention"]
            from omnispec.policies.attention import AUTO_CHOICES

            row["auto_choices"] = {str(k): v for k, v in AUTO_CHOICES.items()}
        save(row)
    # peer: diffusers' dispatcher on the same modules
    import diffusers

    ref = diffusers.FluxPipeline(**mods)
    ref.set_progress_bar_config(disable=True)
    for name in ("native", "_native_flash", "_native_cudnn"):
        try:
            ref.transformer.set_attention_backend(name)
        except Exception as exc:  # noqa: BLE001
            save({"part": "attention", "config": f"diffusers {name}", "error": str(exc).splitlines()[0]})
            continue

        def run(n):
            ref("a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent", **w["diffusers_kwargs"])

        try:
            row = {"part": "attention", "config": f"diffusers {name}", **_measure(run, 2, 4, repeats, flops, ceiling)}
        except Exception as exc:  # noqa: BLE001
            row = {"part": "attention", "config": f"diffusers {name}", "error": str(exc).splitlines()[0]}
        finally:
            ref.transformer.reset_attention_backend()  # diffusers also sets a process-wide active backend
            from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

            _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        save(row)


def compile_part(repeats: int, ceiling: float, save) -> None:
    """Eager, diffusers' compiled blocks and each ``--compile-variants`` configuration on FLUX.1-dev 1024². With
    ``--compile-rounds`` above 1 the compiled configurations are built and timed again in each round, in reverse
    order every other round, so a clock that drifts during the call reaches each alike; their rows pool every
    round's samples (``rounds_ms``: each round's median; each round's row is printed as it comes)."""
    import diffusers

    mods, w, _, flops, eager = _flux_plain("compile", "eager", repeats, ceiling)
    save(eager)
    smoke_backend = [f"policies.compile.backend={SMOKE_COMPILE['backend']}"] if SMOKE_COMPILE else []

    def peer() -> dict:  # on a copy: compilation changes the module it is applied to
        twin = plain_copy(mods["transformer"])
        twin.compile_repeated_blocks(fullgraph=True, **SMOKE_COMPILE)
        run = _diffusers_runner(diffusers.FluxPipeline(**{**mods, "transformer": twin}), w)
        return _compiled_row("compile", "diffusers compile_repeated_blocks", run, flops, repeats, ceiling)

    def variant(name: str) -> dict:
        prepare_model(name, mods["transformer"])
        pipe = _build(w["spec"], mods, [*compile_overrides(name), *smoke_backend])
        row = _compiled_row("compile", name.replace("+", " + "), _runner(pipe, w["request"]), flops, repeats, ceiling)
        unprepare_model(mods["transformer"])
        return row

    configs = {"diffusers compile_repeated_blocks": peer}
    for name in COMPILE_VARIANTS:
        # inductor's options: the smoke's aot_eager backend has none
        if not (SMOKE_COMPILE and harness.inductor_only(name)):
            configs[name.replace("+", " + ")] = functools.partial(variant, name)
    rounds: dict[str, list[dict]] = {label: [] for label in configs}
    for r in range(COMPILE_ROUNDS[0]):
        for label in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            row = configs[label]()
            rounds[label].append(row)
            if COMPILE_ROUNDS[0] == 1:
                save(row)
            else:
                harness.show(row)  # the configuration's row pools the rounds, after the last
            _release({})
            # each configuration compiles afresh in its own mode, and none is guarded against another's entries
            torch._dynamo.reset()
    for rows in rounds.values() if COMPILE_ROUNDS[0] > 1 else ():
        save(_pooled(rows, flops, ceiling))


def _pooled(rows: list[dict], flops: float, ceiling: float) -> dict:
    """One configuration's row over several rounds: the first round's compilation, every round's samples."""
    if len(rows) == 1:
        return rows[0]
    samples = [ms for row in rows for ms in row["samples_ms"]]
    median = statistics.median(samples)
    return {**rows[0], "ms_per_step": median, "samples_ms": samples, "rounds_ms": [row["ms_per_step"] for row in rows],
            "mfu": flops / (median / 1e3) / ceiling, "peak_gib": max(row["peak_gib"] for row in rows)}


def profile_part(repeats: int, ceiling: float, save) -> None:
    """Where a FLUX step's device time goes under each ``--compile-variants`` configuration (eager first): the
    kernels of one profiled request of ``1 + repeats`` steps after a warm-up (its prompt encoding, one-layer stand-ins
    here, counts in), grouped by kind (attention, matmul, inductor's fused kernels, copies, the rest) in ms per step,
    the largest kernels, and the wall time per step beside the device's busy time (their gap: the host)."""
    mods, w, run_plain, _, timed = _flux_plain("profile", "eager (timed)", 1, ceiling)
    harness.show(timed)
    smoke_backend = [f"policies.compile.backend={SMOKE_COMPILE['backend']}"] if SMOKE_COMPILE else []
    save(_profiled("eager", run_plain, repeats))
    for variant in COMPILE_VARIANTS:
        if SMOKE_COMPILE and harness.inductor_only(variant):
            continue
        prepare_model(variant, mods["transformer"])
        pipe = _build(w["spec"], mods, [*compile_overrides(variant), *smoke_backend])
        save(_profiled(variant.replace("+", " + "), _runner(pipe, w["request"]), repeats))
        pipe = None
        unprepare_model(mods["transformer"])
        torch._dynamo.reset()


def _profiled(label: str, run, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        run(2)  # warm-up: compilation, autotuning, the allocator
        run(1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if harness.DEVICE == "cuda" else [])
        harness.sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof, graph_input_copies() as (copied, _):
            run(1 + steps)
            harness.sync()
        wall = time.perf_counter() - start
    row = {"part": "profile", "config": label, "steps_profiled": 1 + steps,
           "wall_ms_per_step": wall * 1e3 / (1 + steps), **harness.kernel_summary(prof, 1 + steps, "_per_step"),
           "idle": idle_summary(prof, 1 + steps),
           "graph_input_copies": [{"shape": list(shape), "dtype": dtype, "copies_per_step": n / (1 + steps),
                                   "mib_per_step": n * nbytes / 2**20 / (1 + steps)}
                                  for (shape, dtype, nbytes), n in copied.most_common()]}
    return row


@contextlib.contextmanager
def graph_input_copies():
    """Count the tensors CUDA graph trees copy into a recorded graph's inputs before each replay (those computed
    outside the graphs: not a parameter, a buffer, a tensor marked static or an earlier graph's output), by shape,
    dtype and bytes, and collect them as (data pointer, shape). Patches a private method of
    ``torch._inductor.cudagraph_trees`` (a diagnostic of this benchmark and the tests: torch reports the copies'
    count, ``cudagraph_recorded_non_static_inputs``, at recording, but not what they are); yields ``(Counter, set)``,
    empty where that method is missing."""
    copied: collections.Counter = collections.Counter()
    sources: set[tuple[int, tuple[int, ...]]] = set()
    from torch._inductor import cudagraph_trees

    node = cudagraph_trees.CUDAGraphNode
    original = getattr(node, "_copy_inputs_and_remove_from_src", None)
    if original is None:
        yield copied, sources
        return

    def counting(self, dsts, srcs):
        for index in self.non_static_input_idx:
            if isinstance(srcs[index], torch.Tensor):
                t = srcs[index]
                copied[(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())] += 1
                sources.add((t.data_ptr(), tuple(t.shape)))
        return original(self, dsts, srcs)

    node._copy_inputs_and_remove_from_src = counting
    try:
        yield copied, sources
    finally:
        node._copy_inputs_and_remove_from_src = original


def idle_summary(prof, per: int, largest: int = 15) -> dict:
    """Where the device waits within a profiled request: the gaps between one kernel's end and the next one's start
    (kernels of all streams merged), in ms per ``per`` steps, grouped by the kernels on either side (a gap before a
    block's first kernel is the host between the blocks' graph replays; before an embedding's, the uncompiled code
    around the blocks), with the largest gaps. Empty off CUDA."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    gaps, reach, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gaps.append((start - reach, before[:60], name[:60]))
        if end >= reach:
            reach, before = end, name
    by_pair: dict[str, list[float]] = {}
    for us, prev, nxt in gaps:
        pair = by_pair.setdefault(f"{prev} -> {nxt}", [0.0, 0])
        pair[0] += us / 1e3 / per
        pair[1] += 1 / per
    top_pairs = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:largest]
    return {"idle_ms_per_step": sum(us for us, _, _ in gaps) / 1e3 / per,
            "span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / per,
            "gaps_over_20us_per_step": sum(us > 20 for us, _, _ in gaps) / per,
            "by_neighbours": [{"between": k, "ms_per_step": v[0], "gaps_per_step": v[1]} for k, v in top_pairs],
            "largest_us": [{"us": us, "after": prev, "before": nxt} for us, prev, nxt in sorted(gaps)[::-1][:largest]]}


def prepare_model(variant: str, transformer: torch.nn.Module) -> None:
    """Apply ``variant``'s model options (``harness.MODEL_OPTIONS``) to ``transformer`` (undone by
    ``unprepare_model``)."""
    if "fused_qkv" in variant.split("+"):
        transformer.fuse_qkv_projections()


def unprepare_model(transformer: torch.nn.Module) -> None:
    transformer.unfuse_qkv_projections()


def _compiled_row(part: str, label: str, run, flops: float, repeats: int, ceiling: float,
                  module: torch.nn.Module | None = None, reference: torch.Tensor | None = None) -> dict:
    """A compiled configuration's row: compilation time, what dynamo did (recompiles, graph breaks) over
    compilation and the timed runs, steady per-step time, and the denoiser's cosine to ``reference``."""
    with harness.CompileWatch() as watch:
        # the first call's time that dynamo's metrics do not count, in a file as it comes (a cut call keeps it)
        with harness.StackSampler(dump_to=harness.stacks_file(RESULTS[0], f"first call {label}")) as stacks:
            if module is not None:
                out, first = harness.first_output(run, module)
                extra = {"denoiser_cosine_vs_bf16": harness.cosine(out, reference)}
            else:
                first, extra = harness.first_call_s(run), {}
        measured = _measure(run, 2, 4, repeats, flops, ceiling)
    return {"part": part, "config": label, "first_call_s": first, **extra, **measured, "dynamo": watch.summary(),
            "first_call_stacks": stacks.top(15)}


def quant_part(repeats: int, ceiling: float, save) -> None:
    """fp8 dynamic quantization (+ regional compile) against bf16 eager, on copies of one set of weights."""

    import diffusers

    mods, w, run_plain, flops, eager = _flux_plain("quant", "bf16 eager", repeats, ceiling)
    reference, _ = harness.first_output(run_plain, mods["transformer"])
    save(eager)
    run_plain = None
    _release(mods, ("transformer",))  # the bf16 original waits on the host: peaks below are the twin's own
    method = "fp8_dynamic" if harness.DEVICE == "cuda" else "int8_weight_only"  # --smoke: a method the CPU runs
    granularities = QUANT_GRANULARITY if method == "fp8_dynamic" else [None]
    modes = QUANT_COMPILE
    for granularity, mode in itertools.product(granularities, modes):  # each on a fresh copy of one set of weights
        policy, base = harness.quantized_transformer(method, granularity, QUANT_EXCLUDE)
        label = base + (f" + {mode.replace('+', ' + ')} compile" if mode != "none" else " eager")
        twin = plain_copy(mods["transformer"])
        prepare_model(mode, twin)  # before the build quantizes it
        pipe = _build(w["spec"], {**mods, "transformer": twin}, [policy, *compile_overrides(mode)])
        run = _runner(pipe, w["request"])
        save(_compiled_row("quant", label, run, flops, repeats, ceiling, twin, reference))
        if QUANT_PROFILE[0]:
            save(_profiled(label, run, repeats))
        pipe = run = twin = None
        _release({})
        torch._dynamo.reset()  # the next configuration compiles afresh
    if not QUANT_PEER[0]:
        return
    granularity = granularities[0]
    # peer: the same torchao config through torchao's quantize_ and diffusers' compile_repeated_blocks
    from torchao.quantization import quantize_

    from omnispec.policies.quantization import torchao_config

    twin = plain_copy(mods["transformer"]).to(harness.DEVICE)
    quantize_(twin, torchao_config(method, granularity))
    peer_mode = modes[-1].split("+")[0]
    if peer_mode == "regional":
        twin.compile_repeated_blocks(fullgraph=True)
    elif peer_mode == "full":
        twin.compile(fullgraph=True)
    run_peer = _diffusers_runner(diffusers.FluxPipeline(**{**mods, "transformer": twin}), w)
    peer_how = {"regional": " + compile_repeated_blocks", "full": " + torch.compile", "none": ""}[peer_mode]
    save(_compiled_row("quant", f"diffusers + torchao {method}{peer_how}", run_peer, flops, repeats, ceiling, twin,
                       reference))


def fp8_block_part(repeats: int, ceiling: float, save) -> None:
    """One FLUX.1-dev single-stream block at 1024² (4096 image + 512 text tokens): bf16 and fp8 (per tensor,
    per row) weights, eager and ``torch.compile``'d, ms per call; plus the top CUDA kernels of the fp8 eager
    call. Separates what fp8 gains per block from what the whole-model runs add (recompiles, glue)."""
    import copy

    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
    from torch.utils.flop_counter import FlopCounterMode
    from torchao.quantization import quantize_

    from omnispec.policies.quantization import torchao_config

    dim, heads, tokens, text = (64, 2, 40, 8) if harness.SMOKE else (3072, 24, 4608, 512)
    with torch.device(harness.DEVICE):
        block = FluxSingleTransformerBlock(dim, heads, dim // heads).to(torch.bfloat16).eval()
        x = torch.randn(1, tokens, dim, dtype=torch.bfloat16)
        temb = torch.randn(1, dim, dtype=torch.bfloat16)
        rope = (torch.randn(tokens, dim // heads), torch.randn(tokens, dim // heads))
    x_img, x_txt = x[:, text:], x[:, :text]
    flops_counter = FlopCounterMode(display=False)

    def call(b):
        return b(hidden_states=x_img, encoder_hidden_states=x_txt, temb=temb, image_rotary_emb=rope)

    with torch.no_grad(), flops_counter:
        reference = torch.cat(call(block), dim=1).float().flatten()
    flops = float(flops_counter.get_total_flops())

    def timed(b) -> list[float]:
        samples = []
        for _ in range(max(repeats, 3) * 10):
            harness.sync()
            start = time.perf_counter()
            call(b)
            harness.sync()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples

    method = "fp8_dynamic" if harness.DEVICE == "cuda" else "int8_weight_only"
    variants = [("bf16", None)] + [(f"{method} {g}" if g else method, g)
                                   for g in (("tensor", "row") if harness.DEVICE == "cuda" else (None,))]
    for name, granularity in variants:
        for compiled in (False, True):
            b = copy.deepcopy(block)
            if name != "bf16":
                quantize_(b, torchao_config(method, granularity))
            with harness.CompileWatch() as watch, torch.no_grad():
                runner = torch.compile(b, fullgraph=True) if compiled else b
                start = time.perf_counter()
                out = torch.cat(call(runner), dim=1).float().flatten()
                harness.sync()
                first = time.perf_counter() - start
                samples = timed(runner)
            med = statistics.median(samples)
            row = {"part": "fp8_block", "config": f"{name} {'compiled' if compiled else 'eager'}",
                   "ms_per_call": med, "tflops": flops / med / 1e9, "mfu": flops / (med / 1e3) / ceiling,
                   "first_call_s": first, "cosine_vs_bf16": harness.cosine(out, reference)}
            if compiled:
                row["dynamo"] = watch.summary()
            if harness.DEVICE == "cuda" and name != "bf16" and not compiled:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
                    call(runner)
                    harness.sync()
                top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]
                row["top_kernels"] = [f"{e.key[:70]} x{e.count} {e.device_time_total / 1e3:.2f} ms" for e in top]
            save(row)
            b = runner = None
            harness.free_device_memory()


def model_offload_part(repeats: int, ceiling: float, save, per_step: bool = True) -> None:
    """Per-step time cancels the moves (they happen once per request), so whole 4-step requests are timed
    too: with the same prompt each time (omnispec's prompt-embedding cache then skips the encoders, so
    nothing moves) and with a new prompt each time (the encoders run, so the denoiser moves out and back)."""
    import diffusers

    w = WORKLOADS["flux"]
    if per_step:  # the resident row's per-step figures come from here
        mods, w, _, flops, resident = _flux_plain("model_offload", "resident", repeats, ceiling)
        harness.show(resident)
    else:
        mods, flops, resident = flux_components(), 0.0, {"part": "model_offload", "config": "resident"}

    def row(base: dict, runner, measure: bool = per_step) -> dict:
        measured = _measure(runner(False), 2, 4, repeats, flops, ceiling) if measure else {}
        steps = 2 if harness.SMOKE else 4
        return base | measured | {"request_s": harness.per_request(runner(False), steps, repeats)[0],
                                  "request_new_prompt_s": harness.per_request(runner(True), steps, repeats)[0]}

    plain = _build(w["spec"], mods, [])
    save(row(resident, lambda fresh: _runner(plain, w["request"], fresh), measure=False))
    plain = None
    _release(mods)
    offloaded = _build(w["spec"], mods, ["policies.offload.strategy=model"])
    measured = row({"part": "model_offload", "config": "model"}, lambda fresh: _runner(offloaded, w["request"], fresh))
    from omnispec.bridge import hook_registry
    from omnispec.policies.offload.model import HOOK_NAME

    placement = hook_registry(offloaded.components["transformer"]).get_hook(HOOK_NAME).placement
    weights = sum(t.numel() * t.element_size() for t in placement.host.values())
    save(measured | {"host_weights_gib": weights / 2**30,
                     "host_page_locked_gib": sum(b.numel() for b in placement.buffers) / 2**30,
                     "copied_back_gib": placement.copied_back / 2**30})
    offloaded = None
    _release(mods)
    peer = diffusers.FluxPipeline(**mods)
    peer.enable_model_cpu_offload(device=harness.DEVICE)
    save(row({"part": "model_offload", "config": "diffusers enable_model_cpu_offload"},
             lambda fresh: _diffusers_runner(peer, w, fresh)))


def wan_attention_part(repeats: int, ceiling: float, save) -> None:
    """``auto`` against each single backend at Wan 14B's attention shapes (8 blocks: the ratio is the point)."""
    mods = wan_components()
    del mods["transformer"].blocks[8:]
    w = WORKLOADS["wan"]
    flops = harness.flops_per_step(_runner(_build(w["spec"], mods, ["policies.attention.default=sdpa"]), w["request"]))
    for backend in ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "auto"):
        try:
            pipe = _build(w["spec"], mods, [f"policies.attention.default={backend}"])
            row = {"part": "wan_attention", "config": backend,
                   **_measure(_runner(pipe, w["request"]), 1, 2, repeats, flops, ceiling)}
        except Exception as exc:  # noqa: BLE001 - an unusable backend is a result, not a crash
            row = {"part": "wan_attention", "config": backend, "error": str(exc).splitlines()[0][:200]}
        if backend == "auto" and "error" not in row:
            row["explain"] = pipe.explain(as_dict=True)["attention"]
        save(row)


def layerwise_part(repeats: int, ceiling: float, save) -> None:
    import diffusers

    mods = wan_components()
    w = WORKLOADS["wan"]
    resident = _build(w["spec"], mods, [])
    run_res = _runner(resident, w["request"])
    flops = harness.flops_per_step(run_res)
    save({"part": "layerwise", "config": "resident", **_measure(run_res, 1, 2, repeats, flops, ceiling)})
    resident = run_res = None
    _release(mods, ("transformer",))
    pipe = _build(w["spec"], mods, ["policies.offload.strategy=layerwise"])
    save({"part": "layerwise", "config": "layerwise", **_measure(_runner(pipe, w["request"]), 1, 2, repeats, flops,
                                                                  ceiling)})
    pipe = mods = None  # group-offload hooks stay on a module: the peer gets freshly built ones
    _release({})
    mods = wan_components()
    mods["transformer"].to("cpu").enable_group_offload(
        torch.device(harness.DEVICE), offload_type="block_level", num_blocks_per_group=1,
        use_stream=harness.DEVICE == "cuda", record_stream=harness.DEVICE == "cuda")
    peer = getattr(diffusers, w["pipeline"])(**mods)
    save({"part": "layerwise", "config": "diffusers enable_group_offload (block level, 1 block, stream)",
          **_measure(_diffusers_runner(peer, w), 1, 2, repeats, flops, ceiling)})


# --smoke: the compile part's torch.compile backend (dynamo traces the same graphs, fullgraph; inductor's CPU code
# generation, minutes on a small CPU, is not the GPU's anyway)
SMOKE_COMPILE: dict[str, str] = {}
QUANT_COMPILE = ["none", "regional"]  # --quant-compile: the compile modes measured with quantization
QUANT_GRANULARITY: list[str | None] = [None]  # --quant-granularity: fp8 scales per tensor or per row
QUANT_EXCLUDE: list[str] = []  # --quant-exclude: modules the quant part's policy leaves unquantized
QUANT_PEER = [True]  # --no-quant-peer: omnispec's rows only (a second process timing a warm compile cache)
QUANT_PROFILE = [False]  # --quant-profile: each quantized row's device time by kernel kind, as the profile part's
COMPILE_VARIANTS = ["regional"]  # --compile-variants
COMPILE_ROUNDS = [1]  # --compile-rounds
RESULTS: list[Path | None] = [None]  # --json: first calls' stack samples are written beside it

PARTS = {"attention": attention_part, "compile": compile_part, "quant": quant_part, "fp8_block": fp8_block_part,
         "model_offload": model_offload_part,
         "offload_requests": functools.partial(model_offload_part, per_step=False),
         "wan_attention": wan_attention_part, "layerwise": layerwise_part, "profile": profile_part}


def _persistent_reductions_up_to(width: int) -> None:
    """Inductor's heuristic choices with row reductions persistent up to ``width`` elements (its own limit: 1,024),
    through its ``inductor_choices_class`` setting, read when the process first compiles."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class WidePersistentReductions(InductorChoices):
        @classmethod
        def uuid(cls) -> str:  # what inductor's cache keys read of a custom choices class
            return f"omnispec-benchmark-persistent-reductions-up-to-{width}"

        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
            if features.get_reduction_hint() == ReductionHint.INNER and not cooperative_reduction:
                return V.graph.sizevars.statically_known_leq(features.reduction_numel, width)
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    config.inductor_choices_class = WidePersistentReductions


def add_arguments(parser) -> None:
    parser.add_argument("--parts", default="attention,compile,quant,model_offload,wan_attention,layerwise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant-compile", default="none,regional",
                        help="compile modes measured with fp8 quantization, options after a '+' as in "
                             "--compile-variants (the last one's mode is the peer's)")
    parser.add_argument("--quant-granularity", default=None, metavar="GRANULARITY[,GRANULARITY...]",
                        help="fp8 scale granularities of the quant part (tensor, row), each with every --quant-compile "
                             "mode, in this order; the first is the peer's (default: torchao's)")
    parser.add_argument("--no-quant-peer", action="store_true", help="skip the quant part's diffusers peer")
    parser.add_argument("--quant-profile", action="store_true",
                        help="after each quantized row, where its step's device time goes (as --parts profile)")
    parser.add_argument("--persistent-reductions-up-to", type=int, default=0, metavar="N",
                        help="an experiment: inductor makes a row reduction persistent (the row held in registers, "
                             "read once) up to N wide instead of its own 1,024, for the whole process")
    inductor_passes.add_argument(parser)
    parser.add_argument("--quant-exclude", default="", metavar="MODULE[,MODULE...]",
                        help="the quant part's quantization.exclude (e.g. FLUX's modulation linears: "
                             "norm1,norm1_context,norm,norm_out)")
    parser.add_argument("--compile-variants", default="regional",
                        help="omnispec compile configurations of the compile part, comma-separated: a mode, each "
                             "option after a '+' (e.g. regional,regional+cudagraphs,regional+autotune); the option "
                             "fused_qkv fuses each attention's projections first (diffusers' fuse_qkv_projections); "
                             "qk_norm_rope sets policies.attention.fused_qk_norm_rope, fused_gelu "
                             "policies.mlp.fused_gelu")
    parser.add_argument("--compile-rounds", type=int, default=1, metavar="N",
                        help="build and time the compile part's compiled configurations N times, in reverse order "
                             "every other round, and pool the samples (for differences smaller than a call's drift)")


def benchmark(args, results: harness.Results) -> None:
    if args.persistent_reductions_up_to:
        _persistent_reductions_up_to(args.persistent_reductions_up_to)
    inductor_passes.install(args.inductor_passes)
    QUANT_COMPILE[:] = args.quant_compile.split(",")
    COMPILE_VARIANTS[:] = args.compile_variants.split(",")
    COMPILE_ROUNDS[:] = [max(1, args.compile_rounds)]
    QUANT_PEER[:] = [not args.no_quant_peer]
    QUANT_PROFILE[:] = [args.quant_profile]
    QUANT_GRANULARITY[:] = args.quant_granularity.split(",") if args.quant_granularity else [None]
    if unknown := set(QUANT_GRANULARITY) - {None, "tensor", "row"}:
        raise harness.UsageError(f"--quant-granularity: unknown {sorted(unknown)}; choose tensor or row")
    RESULTS[:] = [args.json]
    QUANT_EXCLUDE[:] = [m for m in args.quant_exclude.split(",") if m]
    if args.smoke:
        SMOKE_COMPILE["backend"] = "aot_eager"
    ceiling = harness.matmul_ceiling()
    results.header["ceiling_tflops"] = ceiling / 1e12
    for part in args.parts.split(","):
        try:
            PARTS[part](args.repeats, ceiling, results.save)
        except Exception as exc:  # noqa: BLE001 - keep the other parts' results
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            results.save({"part": part, "error": f"{type(exc).__name__}: {first_line}"})
        harness.free_device_memory()
    table(results.rows)


def table(rows: list[dict]) -> None:
    print("| part | config | ms/step | MFU | peak GiB |")
    for r in rows:
        if "error" in r:
            print(f"| {r['part']} | {r.get('config', '')} | error: {r['error'][:80]} | | |")
        elif "ms_per_step" not in r and "request_s" in r:
            print(f"| {r['part']} | {r['config']} | request {r['request_s']:.2f} s, new prompt "
                  f"{r['request_new_prompt_s']:.2f} s | | |")
        elif r["part"] == "profile":
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["kinds_ms_per_step"].items())
            print(f"| profile | {r['config']} | wall {r['wall_ms_per_step']:.1f}, device busy "
                  f"{r['device_busy_ms_per_step']:.1f} ({kinds}) | | |")
        elif "ms_per_call" in r:
            print(f"| {r['part']} | {r['config']} | {r['ms_per_call']:.2f} per call | {r['mfu']:.0%} | |")
        else:
            print(f"| {r['part']} | {r['config']} | {r['ms_per_step']:.1f} | {r['mfu']:.0%} | {r['peak_gib']:.1f} |")


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark)


if __name__ == "__main__":
    main()
