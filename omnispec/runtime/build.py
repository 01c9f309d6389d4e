"""``build(spec)``: validate, check the checkpoint, load components, apply policies, return a Pipeline."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..policies import apply_policies, check_policies, resolve_device
from ..policies import quantization
from ..spec import PipelineSpec, SpecError, load_spec
from ..spec.checkpoint import checkpoint_problems, follow_checkpoint, read_configs, unresolved
from . import distributed
from .components import check_source, load_adapter_slots, load_components
from .families import family_class
from .pipeline import Pipeline


def build(
    spec_or_path: PipelineSpec | str | Path | dict,
    source: str | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device | None = None,
    *,
    components: Mapping[str, Any] | None = None,
    process_group: Any = None,
    trust_code: bool = False,
    pipeline_class: type[Pipeline] = Pipeline,
) -> Pipeline:
    """Build a runnable pipeline.

    ``source`` replaces ``model.source`` (a local directory or Hub id); ``overrides`` are dotted
    ``key=value`` strings as for ``load_spec``; ``device`` replaces ``runtime.device``. Everything that
    can be checked without weights (family needs, policies against the device, the checkpoint's
    presence) is checked before the first weight loads. ``components`` supplies already-built modules
    by name (an RL trainer's, or random weights for a benchmark); only the others are loaded. With
    ``policies.parallel`` degrees above 1, the pipeline joins the initialised default process group (or
    ``process_group``), or initialises one from torchrun's environment. ``pipeline_class`` is what to
    return (``omnispec.build`` asks for the ``RLPipeline``, which adds rollouts).
    """
    if isinstance(spec_or_path, PipelineSpec):
        spec = spec_or_path
        if overrides:
            from ..spec import dump_spec
            import yaml

            spec = load_spec(yaml.safe_load(dump_spec(spec)), overrides, trust_code=trust_code)
    else:
        spec = load_spec(spec_or_path, overrides, trust_code=trust_code)
    family_cls = family_class(spec.model.family)
    family_cls.check_spec(spec)
    target = resolve_device(device or spec.runtime.device)
    check_policies(spec, family_cls, target)
    par = spec.policies.parallel
    if par.ring * par.ulysses > 1:
        if not family_cls.context_parallel:
            raise SpecError.single(f"family {family_cls.name!r} has no context-parallel plan for ulysses/ring",
                                   "policies.parallel")
        attention = spec.policies.attention
        for backend in (attention.default, *attention.per_role.values()):
            if backend in ("xformers", "sage"):
                raise SpecError.single(f"attention backend {backend!r} cannot run under sequence parallelism",
                                       "policies.attention")
    parallel = distributed.setup(spec, target, process_group)
    if parallel is not None and target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    given = dict(components or {})
    unknown = sorted(set(given) - set(spec.model.components))
    if unknown:
        raise SpecError.single(f"components {unknown} are not in the spec's profile", "components")
    missing = {n: c for n, c in spec.model.components.items() if n not in given}
    root = check_source(spec, source, missing) if missing else None
    spec = _against_checkpoint(spec, root)
    loaded = load_components(spec, root, only=missing) if root is not None else {}
    modules = {name: given.get(name, loaded.get(name)) for name in spec.model.components}
    quantized = [note for name in given if (note := quantization.quantize_in_memory(
        spec, name, spec.model.components[name], given[name], target))]
    load_adapter_slots(spec, modules)
    applied = apply_policies(spec, family_cls, modules, target)
    if quantized:
        applied.notes["quantization"] = "; ".join(quantized)
    if parallel is not None and parallel.sp_mesh is not None:
        denoisers = {n: modules[n] for n, c in spec.model.components.items() if c.role == "denoiser"}
        distributed.enable_sequence_parallel(parallel, family_cls, denoisers)
    family = family_cls(spec, modules, target)
    return pipeline_class(spec, family, modules, target, applied, parallel)


def _against_checkpoint(spec: PipelineSpec, root: str | None) -> PipelineSpec:
    """Refuse a spec that disagrees with the checkpoint's config files; resolve its ``from_checkpoint`` values."""
    if root is None:
        if unresolved(spec):
            raise SpecError.single("the spec follows the checkpoint for some values (from_checkpoint), but every "
                                   "component was given in memory: there is no checkpoint to read them from",
                                   "model.source")
        return spec
    configs = read_configs(spec, root)
    problems = checkpoint_problems(spec, configs)
    if problems:
        raise SpecError(problems)
    return follow_checkpoint(spec, configs)
