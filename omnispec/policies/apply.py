"""The one place policies are checked against the target and applied, in one order: quantization (at load, see
``quantization.load_kwargs``), attention, MLP, cache, placement by the offload strategy (``none`` puts every component
on the device), compile, the VAE's tiling and slicing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..spec import PipelineSpec, SpecError
from ..spec.errors import Problem
from ..spec.policies import KERNEL_POLICIES
from ..targets import Targets
from . import quantization
from .attention import AttentionPlan, apply_attention
from .attention_kernels import usable
from .caches import CacheRuntime, apply_cache
from .compile import apply_compile, backend_problem
from .mlp import apply_mlp
from .modulation import ModulationStep, apply_modulation
from .offload import apply_offload
from .presets import PresetOutcome
from .sparse_attention import apply_sparse_attention
from .steps import StepPolicies, StepPolicy
from .vae import apply_vae


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError.single(f"device {device!r} requested but CUDA is not available here", "runtime.device")
    return torch.device(device)


@dataclass
class AppliedPolicies:
    """What a build applied: the attention plan, the cache (None: none), the step policies the loop consults
    (``steps``: the cache, the modulation table), explain's notes and what the preset did."""

    attention: AttentionPlan = field(default_factory=AttentionPlan)
    cache: CacheRuntime | None = None
    steps: StepPolicies = field(default_factory=StepPolicies)
    notes: dict[str, str] = field(default_factory=dict)
    preset: PresetOutcome | None = None


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _quantized_modulation(spec: PipelineSpec, targets: Targets) -> str | None:
    """The quantization entry (``policies.quantization.<key>``) that covers a denoiser's modulation linears, or None.
    An exclude entry leaves a linear out where ``.<entry>.`` is part of ``.<its name>.``, as at load; checked
    against the target's leaf names (``norm1.linear``), the build checks the modules themselves."""
    denoisers = {name for name, c in spec.model.components.items() if c.role == "denoiser"}
    for key, q in spec.policies.quantization.items():
        if key != "denoiser" and key not in denoisers:
            continue
        if not all(any(f".{entry}." in f".{leaf}." for entry in q.exclude) for leaf in targets.modulation.leaves()):
            return f"policies.quantization.{key}"
    return None


def check_policies(spec: PipelineSpec, targets: Targets, device: torch.device) -> None:
    """Refuse what cannot run here, naming the field; nothing is loaded yet."""
    if problems := policy_problems(spec, targets, device):
        raise SpecError(problems)


def policy_problems(spec: PipelineSpec, targets: Targets, device: torch.device) -> list[Problem]:
    """What cannot run here, each naming its field (``check_policies`` refuses them; a preset leaves out a field that
    would add one)."""
    p = spec.policies
    problems: list[Problem] = list(quantization.check(spec, device))
    dtype = _DTYPES[spec.model.dtype]
    names = targets.attention.names()
    for role in p.attention.per_role:
        if role not in names:
            problems.append(Problem(f"policies.attention.per_role.{role}", f"family {targets.family!r} has no "
                                    f"attention role {role!r} (roles: {', '.join(names)})"))
    if p.attention.fused_qk_norm_rope and targets.attention.qk_norm_rope_processor is None:
        problems.append(Problem("policies.attention.fused_qk_norm_rope",
                                targets.missing("qk_norm_rope") + " (the FLUX families have one)"))
    if p.mlp.precomputed_modulation:
        if targets.modulation is None:
            problems.append(Problem("policies.mlp.precomputed_modulation",
                                    targets.missing("modulation") + " (the FLUX and Qwen-Image families have one)"))
        elif p.offload.strategy != "none":
            problems.append(Problem("policies.mlp.precomputed_modulation",
                                    f"the table is built on the device from the denoiser's weights, which offload "
                                    f"{p.offload.strategy!r} keeps off it; use offload none"))
        elif quantized := _quantized_modulation(spec, targets):
            problems.append(Problem("policies.mlp.precomputed_modulation",
                                    f"{quantized} quantizes the modulation linears, which the table cannot stand in "
                                    f"for: add exclude: [{', '.join(targets.modulation.leaves())}] to it or set "
                                    "this false"))
        elif p.parallel.shard > 1:
            problems.append(Problem("policies.mlp.precomputed_modulation",
                                    f"the table is built from the denoiser's whole weights, which shard "
                                    f"{p.parallel.shard} splits over the ranks (whole only inside each block's "
                                    "forward); set this false or shard 1"))
    if p.attention.sparse is not None and targets.video_tokens is None:
        problems.append(Problem("policies.attention.sparse", targets.missing("video_tokens")))
    elif p.attention.sparse is not None and p.compile.mode != "none" and targets.video_tokens.compiled_refusal:
        problems.append(Problem("policies.attention.sparse", targets.refused(
            f"sparse attention under policies.compile.mode {p.compile.mode!r}",
            f"{targets.video_tokens.compiled_refusal}; use compile none")))
    for i, kernel in enumerate(p.kernels):
        if (refusal := KERNEL_POLICIES.implementation(kernel).refusal(kernel, targets)) is not None:
            problems.append(Problem(f"policies.kernels.{i}", refusal))
    limit = targets.cache_limits.get(p.cache.kind)
    if limit:
        problems.append(Problem("policies.cache.kind", targets.refused(f"the {p.cache.kind} cache", limit)))
    if compile_problem := backend_problem(spec):
        problems.append(Problem("policies.compile.backend", compile_problem))
    explicit = {("default",): p.attention.default} | {("per_role", r): b for r, b in p.attention.per_role.items()}
    for where, backend in explicit.items():
        if backend == "auto" or p.attention.allow_fallback:
            continue
        reason = usable(backend, device, dtype, 128)
        if reason is not None:
            problems.append(Problem(f"policies.attention.{'.'.join(where)}", f"{backend} cannot run here: {reason}"))
    return problems


def apply_policies(spec: PipelineSpec, targets: Targets, components: dict[str, Any],
                   device: torch.device) -> AppliedPolicies:
    """Device placement, attention, MLP, cache, offload, compile (quantization already happened at load)."""
    applied = AppliedPolicies()
    denoisers = {n: components[n] for n, c in spec.model.components.items() if c.role == "denoiser"}
    sparse, sparse_note = apply_sparse_attention(spec, targets.video_tokens, targets.attention, denoisers)
    applied.attention = apply_attention(spec, targets.attention, denoisers, device)  # its hooks outside sparse's
    if sparse_note is not None:
        applied.notes["sparse attention"] = sparse_note
    if (mlp := apply_mlp(spec, targets, denoisers)) is not None:
        applied.notes["mlp"] = mlp
    if (modulation := apply_modulation(spec, targets.modulation, denoisers)) is not None:
        applied.notes["modulation"] = modulation
    applied.cache = apply_cache(spec, components)
    steps: list[StepPolicy] = [applied.cache] if applied.cache is not None else []
    if sparse is not None:
        steps.append(sparse)
    if modulation is not None:
        steps.append(ModulationStep())
    applied.steps = StepPolicies(steps)
    applied.notes["offload"] = apply_offload(spec, components, device)
    for kernel in spec.policies.kernels:  # a plugin's, after the built-in ones and before compile traces them
        applied.notes[kernel.kind] = KERNEL_POLICIES.implementation(kernel).apply(kernel, targets, denoisers)
    applied.notes["compile"] = apply_compile(spec, targets.blocks, components)
    if (vae := apply_vae(spec, components)) is not None:
        applied.notes["vae"] = vae
    if applied.cache is not None:
        applied.notes["cache"] = applied.cache.kind + ("" if applied.cache.separate_passes else " (loop-level reuse)")
    return applied
