"""``omnispec explain --estimate``: what a run will cost, before any weight loads.

- **Parameter bytes** per component from its safetensors headers (the first few KB of each file: names, dtypes,
  shapes), counted in the dtype the component loads in and under the declared quantization (torchao/bitsandbytes
  store a quantized ``Linear`` weight in 1 byte per value for fp8/int8, half a byte for int4/nf4, plus scales). A
  component without safetensors is counted from its config, built on the meta device.
- **FLOPs per denoiser forward**, counted on the meta device: every weighted component is built from its config
  on ``meta`` (no memory), the family encodes a prompt and runs its denoiser exactly as a request would, and each
  matmul, convolution and attention call is counted (torch's ``flop_registry``; attention as ``4 B H Lq Lk D``).
- **Peak device memory** under the declared offload policy: the weights on the device in each stage (encode,
  denoise, decode) plus that stage's activations, which the meta run measures as the largest total size of live
  tensors (attention as the fused kernels run it: no score matrix).
- **Time per step**, from the counts and a device kind's published figures (``devices.py``; nothing is timed live):
  the forward's FLOPs at the peak for the denoiser's dtype times the share a forward reaches, the other ops' bytes
  at the memory bandwidth, or their launch cost where larger; under layerwise/group offload the host-to-device copy
  of the denoiser's blocks over the host link (overlapped with compute when prefetching).

Encoding and decoding time are not estimated; ``render_estimate`` says what each number covers.
"""


from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..log import logger, progress
from ..spec import PipelineSpec, SpecError
from ..spec.files import path_kind, user_path
from ..spec.model import WEIGHTLESS_ROLES
from ..spec.policies import OFFLOADS
from ..targets import ModulationTarget
from .counting import Shadow, counting
from .devices import BANDWIDTH_SHARE, COMPILED_SHARE, EAGER_SHARE, DeviceKind, device_kind
from .report import ComponentBytes, Estimate, OpCount, render_estimate
from .weights import STAGE_ROLES, component_bytes, config_module

# ---- the estimate -------------------------------------------------------------------------------------------

def estimate(spec: PipelineSpec, source: str | None = None, kind: str | None = None, *, trust_code: bool = False,
             **request: Any) -> Estimate:
    """Estimate a request of ``spec`` (its recipe's defaults, or ``request`` fields) on a device of ``kind``
    (``devices.NAMES``: h200, h100, a100, l40s, 4090, cpu; default: this machine's) from the checkpoint at
    ``source`` (else ``model.source``; a local folder or the Hub cache), loading no weights and timing nothing.
    ``trust_code`` lets the components' configs name code for their loaders (``--trust-code``), as ``build``'s."""
    target = device_kind(kind, spec.runtime.threads)
    root = _checkpoint_root(spec, source)
    from ..runtime.families import family_class
    from ..spec.checkpoint import checkpoint_problems, follow_checkpoint, read_configs

    configs = read_configs(spec, str(root), trusted=trust_code)
    problems = checkpoint_problems(spec, configs, family_class(spec.model.family).checkpoints.foreign_components)
    if problems:
        raise SpecError(problems)
    from ..runtime.components import check_source

    check_source(spec, str(root), trusted=trust_code)  # the folders, JSON files and weights headers, as build does
    spec = follow_checkpoint(spec, configs)
    modules, counts = _modules(spec, root)
    result = Estimate(target.name, {}, counts)
    with progress("estimate: counting the denoiser's FLOPs and activations on the meta device"):
        _count_run(spec, modules, result, request)
    _peak(spec, result, modules)
    _time(result, target, spec)
    return result


def _checkpoint_root(spec: PipelineSpec, source: str | None) -> Path:
    root = source or spec.model.source
    where = "--source" if source else "model.source"  # what the user gave: the flag, or the spec's field
    if not root:
        raise SpecError.single("no checkpoint: the spec has no model.source and no --source was given", "--source")
    local = user_path(root)
    if path_kind(local) == "dir":
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the Hub cache's snapshot: config files and safetensors headers are read from there
        return Path(snapshot_download(root, revision=spec.model.revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise SpecError.single(f"{root!r} is neither a local checkpoint folder nor in the Hub cache; the estimate "
                               "reads config files and safetensors headers from disk: pass --source DIR", where
                               ) from None


def _modules(spec: PipelineSpec, root: Path) -> tuple[dict[str, Any], list[ComponentBytes]]:
    """Weighted components on meta (with their byte counts); tokenizers, processors and schedulers loaded (small)."""
    from ..runtime.components import DTYPES, component_class, load_components

    light = {n: c for n, c in spec.model.components.items() if c.role in WEIGHTLESS_ROLES}
    quiet = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"progress": False})})
    modules: dict[str, Any] = load_components(quiet, str(root), only=light) if light else {}
    counts = []
    for name, component in spec.model.components.items():
        if name in light:
            continue
        folder = Path(component.source or root) / (component.subfolder or "")
        cls = component_class(component)
        module = None
        if component.file is None or (folder / "config.json").is_file():  # a single file's config is its folder's
            try:
                module = config_module(cls, folder, DTYPES[component.dtype or spec.model.dtype], component.config,
                                       where=f"model.components.{name}")
            except SpecError:  # a config refused as an input (too deep, too large, too many modules)
                raise
            except (OSError, ValueError, TypeError) as exc:
                logger.warning(f"estimate: {name} not built on meta ({exc}); its FLOPs are not counted")
        modules[name] = module
        counts.append(component_bytes(spec, name, component, folder, module, root))
    return modules, counts


def _stand_in_inputs(spec: PipelineSpec, fields: dict[str, Any]) -> dict[str, Any]:
    """Grey pictures for what the recipe's task needs and ``fields`` does not give (an image, an inpainting mask, a
    video), at the recipe's default size: an estimate's costs depend on their sizes, not their pixels."""
    from PIL import Image

    from ..spec.recipe import IMAGE_TASKS, VIDEO_TASKS

    task, defaults = spec.recipe.task, spec.recipe.defaults
    height = fields.get("height") or defaults.height or 512
    size = (fields.get("width") or defaults.width or height, height)
    given: dict[str, Any] = {}
    if task in IMAGE_TASKS and "image" not in fields and "conditions" not in fields:
        given["image"] = Image.new("RGB", size, (128, 128, 128))
    if task == "inpainting" and "mask" not in fields:
        given["mask"] = Image.new("L", size, 255)
    if task in VIDEO_TASKS and "video" not in fields:
        given["video"] = [Image.new("RGB", size, (128, 128, 128))] * (fields.get("frames") or defaults.frames or 1)
    return given


def _count_run(spec: PipelineSpec, modules: dict[str, Any], result: Estimate, fields: dict[str, Any]) -> None:
    """One request's first denoiser forward (and its decode) on meta: FLOPs, op shapes, peak live bytes."""
    from ..runtime.families import Conditioning, family_class
    from ..runtime.plan import plan_request
    from ..runtime.run import phase_passes
    from ..spec.request import resolve_request

    phase = spec.recipe.phases[0]
    result.denoiser = phase.denoiser
    if any(m is None for m in modules.values()):
        result.notes.append("FLOPs not counted: a component could not be built on the meta device")
        return
    meta = torch.device("meta")
    request = resolve_request(spec, "a photo of a cat", 0, **_stand_in_inputs(spec, fields), **fields)
    result.request = {k: v for k, v in request.model_dump(
        exclude={"images", "video", "mask", "references", "prompts", "seeds"}).items() if v not in (None, "")}
    result.steps = request.steps
    shadow = Shadow()
    try:
        family = family_class(spec.model.family)(spec, modules, meta)
        # the request's plan, as a run makes it (schedules on the host: they are tiny, and their sigmas are read)
        plan = plan_request(spec, family, modules, torch.device("cpu"), request)
        walk = plan.walks[0]
        first = walk.phases[0]
        step_plan = next(p for p in first.plans.values() if p.passes)  # CFG-zero*'s zero-init steps run no pass
        geometry, generators = walk.geometry, plan.generators
        with counting(shadow) as counter:
            latents = family.initial_latents(geometry, generators)
            positive = family.encode(list(request.prompts), request)
            image_cond = family.encode_images(request, geometry, generators)
        result.activation_bytes["encode"] = counter.peak
        passes = phase_passes(first.phase, positive.with_(image_cond), positive.with_(image_cond))
        names = list(step_plan.passes)
        result.passes = len(names)
        tokens = family.tokens(geometry)
        rows = len(names) if walk.max_rows is None else max(1, min(walk.max_rows, len(names)))
        result.rows_per_forward = rows
        result.forwards_per_step = math.ceil(len(names) / rows)
        with counting(shadow) as counter:
            cond = Conditioning.cat([passes.conditions[n] for n in names[:rows]])
            x = {s: torch.cat([v] * rows) for s, v in latents.items()}
            t = torch.full((), 500.0, device=meta)
            landing = {"target": walk.steps.target(0).to(meta)} if family.flow_map else {}
            family.predict(modules[first.phase.denoiser], x, t, cond, geometry, embedded=step_plan.embedded,
                           **landing)
        result.forward_flops = sum(g.flops * g.calls for g in counter.groups.values())
        result.step_flops = result.forward_flops * len(names) / rows
        result.activation_bytes["denoise"] = counter.peak + _modulation_table(spec, family.targets.modulation, modules[
            first.phase.denoiser], request.steps * len(names), result)
        result.ops = sorted(counter.groups.values(), key=lambda g: -g.flops * g.calls)
        result.kernels, result.moved_bytes = counter.kernels, counter.moved
        result.notes.append(f"request: 1 sample, {len(names)} pass(es) per step in {result.forwards_per_step} "
                            f"forward(s) of {rows} row(s), {tokens} image tokens per row")
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError, IndexError) as exc:
        logger.debug("estimate: the meta forward failed", exc_info=True)
        result.notes.append(f"FLOPs not counted: the denoiser forward did not run on the meta device ({exc})")
        return
    # The VAE runs; converting its pixels on the host then fails on meta, which a modular pipeline's decode block
    # would also log as an error with its traceback: expected here, so its logger is quiet for the call.
    with counting(shadow) as counter, _logger_quiet("diffusers.modular_pipelines.modular_pipeline"):
        try:
            family.decode(latents, geometry)
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
            pass
    result.activation_bytes["decode"] = counter.peak


@contextmanager
def _logger_quiet(name: str) -> Iterator[None]:
    """The named logger says nothing for the block."""
    quiet = logging.getLogger(name)
    disabled, quiet.disabled = quiet.disabled, True
    try:
        yield
    finally:
        quiet.disabled = disabled


def _modulation_table(spec: PipelineSpec, target: ModulationTarget | None, denoiser: Any, rows: int,
                      result: Estimate) -> int:
    """The modulation table's bytes under ``precomputed_modulation`` (``rows``: at most one per step and pass),
    noted; 0 without it."""
    if not spec.policies.mlp.precomputed_modulation or target is None:
        return 0
    from ..policies.modulation import modulation_linears, padded_rows, row_bytes

    size = padded_rows(rows) * row_bytes(modulation_linears(target, denoiser))
    result.notes.append(f"modulation table: at most {size / 2**20:.0f} MiB on the device during the denoise (at most "
                        f"{rows} rows: one per step and pass; a pass of the same prompt shares its row)")
    return size


def _peak(spec: PipelineSpec, result: Estimate, modules: dict[str, Any]) -> None:
    """Weights on one rank's device in each stage under the offload policy (and the weight axes: ``ranks.py``),
    plus that stage's activations."""
    from ..runtime.families import family_class
    from .ranks import per_rank

    offload = spec.policies.offload
    strategy = OFFLOADS.implementation(offload)
    stages = {stage: strategy.device_bytes(offload, stage, roles, result.components, result.device != "cpu")
              for stage, roles in STAGE_ROLES.items()}
    result.weights_on_device = stages
    if not getattr(offload, "distributed", False):  # distributed offload: per rank, in the mesh lines
        result.host_bytes = strategy.host_bytes(offload, result.components)
    per_rank(spec, family_class(spec.model.family).targets.parallel, modules, result)
    peaks = {stage: stages[stage] + result.activation_bytes.get(stage, 0) for stage in stages}
    result.peak_stage = max(peaks, key=lambda s: peaks[s])
    result.peak_bytes = peaks[result.peak_stage]


def _time(result: Estimate, kind: DeviceKind, spec: PipelineSpec) -> None:
    """Per step: the forward's FLOPs at the device's peak for the denoiser's dtype (fp8 under an fp8 quantization)
    and the share a forward reaches, the other ops' bytes at its bandwidth, or their launches where slower; under
    layerwise/group offload the blocks' host-to-device copies (overlapped with compute when prefetching)."""
    if not result.forward_flops:
        return
    phase = spec.recipe.phases[0]
    component = spec.model.components[phase.denoiser]
    dtype = component.dtype or spec.model.dtype
    quant = spec.policies.quantization.get(phase.denoiser) or spec.policies.quantization.get("denoiser")
    if quant is not None and quant.method.startswith("fp8") and "float8" in kind.tflops:
        dtype = "float8"
    compiled = spec.policies.compile.mode != "none"
    result.compute_seconds = kind.seconds(result.forward_flops, dtype, compiled)
    result.memory_seconds = (result.moved_bytes or 0) / (kind.bandwidth * BANDWIDTH_SHARE)
    result.overhead_seconds = 0.0 if compiled else (result.kernels or 0) * kind.launch_seconds
    # On a GPU kernels run back to back while the host queues the next ones: the slower of the two sets the pace. On
    # a CPU the dispatching thread runs each op itself: the two add up.
    device_seconds = result.compute_seconds + result.memory_seconds
    per_forward = (max(device_seconds, result.overhead_seconds) if kind.overlaps
                   else device_seconds + result.overhead_seconds)
    offload = spec.policies.offload
    if offload.streams_blocks and kind.host_link is not None:
        streamed = sum(sum(c.blocks.values()) for c in result.components if c.role == "denoiser")
        result.transfer_seconds = streamed / kind.host_link
        per_forward = (max(per_forward, result.transfer_seconds) if offload.prefetch
                       else per_forward + result.transfer_seconds)
    result.step_seconds = per_forward * result.forwards_per_step
    result.timed_for = (f"{kind.name} ({kind.basis}): {kind.tflops[dtype]:.3g} TFLOP/s {dtype} peak x "
                        f"{dtype_share(kind, compiled):.0%}")


def dtype_share(kind: DeviceKind, compiled: bool) -> float:
    return kind.share or (COMPILED_SHARE if compiled else EAGER_SHARE)


__all__ = ["ComponentBytes", "Estimate", "OpCount", "Shadow", "config_module", "counting", "estimate", "render_estimate"]
