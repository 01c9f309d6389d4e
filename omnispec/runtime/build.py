"""``build(spec)``: validate, check the checkpoint, load components, apply policies, return a Pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..policies import apply_policies, check_policies, resolve_device
from ..spec import PipelineSpec, load_spec
from .components import check_source, load_components
from .families import family_class
from .pipeline import Pipeline


def build(
    spec_or_path: PipelineSpec | str | Path | dict,
    source: str | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device | None = None,
    *,
    trust_code: bool = False,
) -> Pipeline:
    """Build a runnable pipeline.

    ``source`` replaces ``model.source`` (a local directory or Hub id); ``overrides`` are dotted
    ``key=value`` strings as for ``load_spec``; ``device`` replaces ``runtime.device``. Everything that
    can be checked without weights (family needs, policies against the device, the checkpoint's
    presence) is checked before the first weight loads.
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
    root = check_source(spec, source)
    components = load_components(spec, root)
    apply_policies(spec, family_cls, components, target)
    family = family_cls(spec, components, target)
    return Pipeline(spec, family, components, target)
