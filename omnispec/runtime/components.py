"""Load a spec's components with their classes, subfolders and dtypes, through ``from_pretrained``.

Loading goes through diffusers'/transformers' own ``from_pretrained`` so that a local directory and a
Hub id take the same path; ``check_source`` runs first so a missing checkpoint is reported before any
weight is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..spec import Component, PipelineSpec, SpecError
from ..policies import quantization
from .families import import_ref

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
from ..spec.model import WEIGHTLESS_ROLES as _WEIGHTLESS


def component_class(component: Component) -> type:
    ref = component.class_
    if ":" not in ref and ref.count(".") == 1:  # 'diffusers.Name' / 'transformers.Name'
        package, name = ref.split(".")
        ref = f"{package}:{name}"
    cls = import_ref(ref)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise SpecError.single(f"{component.class_!r} has no from_pretrained", "model.components")
    return cls


def check_source(spec: PipelineSpec, source: str | None, names: Iterable[str] | None = None) -> str:
    """Resolve the checkpoint root and check the components' files are reachable, loading nothing."""
    wanted = set(spec.model.components if names is None else names)
    root = source or spec.model.source
    if not root:
        raise SpecError.single("no checkpoint: the spec has no model.source and no --source was given", "model.source")
    local = Path(root).expanduser()
    if local.exists():
        if not local.is_dir():
            raise SpecError.single(f"checkpoint root {root!r} is not a directory", "model.source")
        missing = [
            f"{name} ({c.subfolder})"
            for name, c in spec.model.components.items()
            if name in wanted and c.subfolder and not (local / c.subfolder).is_dir()
        ]
        if missing:
            raise SpecError.single(f"checkpoint {root!r} lacks component folder(s): {', '.join(missing)}", "model.source")
        return str(local)
    if root.startswith((".", "/", "~")) or root.count("/") != 1:
        raise SpecError.single(f"checkpoint {root!r} is neither a local directory nor a Hub id (owner/name)", "model.source")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        for name, c in spec.model.components.items():
            if name not in wanted:
                continue
            probe = f"{c.subfolder}/config.json" if c.subfolder and c.role not in _WEIGHTLESS else None
            if probe and not isinstance(try_to_load_from_cache(root, probe, revision=spec.model.revision), str):
                raise SpecError.single(
                    f"Hub checkpoint {root!r} is not in the local cache and HF_HUB_OFFLINE is set (component {name!r})",
                    "model.source",
                )
    return root


def load_components(spec: PipelineSpec, root: str, only: Mapping[str, Component] | None = None) -> dict[str, Any]:
    """The components (all, or ``only`` these), on the CPU, in their dtypes; placement is a policy step."""
    out: dict[str, Any] = {}
    for name, component in (only if only is not None else spec.model.components).items():
        cls = component_class(component)
        kwargs: dict[str, Any] = {}
        if component.subfolder:
            kwargs["subfolder"] = component.subfolder
        if spec.model.revision:
            kwargs["revision"] = spec.model.revision
        if component.role not in _WEIGHTLESS:
            kwargs["dtype"] = DTYPES[component.dtype or spec.model.dtype]
            kwargs |= quantization.load_kwargs(spec, name, component, cls)
        try:
            if component.file:
                out[name] = cls.from_single_file(str(Path(root) / (component.subfolder or "") / component.file), **{
                    k: v for k, v in kwargs.items() if k == "dtype"})
            else:
                out[name] = cls.from_pretrained(root, **kwargs)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError.single(f"cannot load component {name!r} ({component.class_}) from {root!r}: {first}",
                                   f"model.components.{name}") from None
        if isinstance(out[name], torch.nn.Module):
            out[name].eval().requires_grad_(False)
    return out


def adapter_target(spec: PipelineSpec, slot: str) -> str:
    """The component a LoRA slot loads into: its ``target``, else the denoiser of the first phase using it."""
    adapter = spec.model.adapters[slot]
    if adapter.target:
        return adapter.target
    users = [p.denoiser for p in spec.recipe.phases if p.adapter == slot]
    return users[0] if users else spec.recipe.phases[0].denoiser


def load_adapter_slots(spec: PipelineSpec, modules: dict[str, Any]) -> None:
    """Load every LoRA slot with diffusers' PEFT integration (``load_lora_adapter``), all switched off;
    phases switch their slot on as they start."""
    for slot, adapter in spec.model.adapters.items():
        target = adapter_target(spec, slot)
        module = modules[target]
        if not hasattr(module, "load_lora_adapter"):
            raise SpecError.single(f"component {target!r} ({type(module).__name__}) cannot take LoRA adapters",
                                   f"model.adapters.{slot}")
        kwargs: dict[str, Any] = {"adapter_name": slot, "prefix": None}
        kwargs |= {"weight_name": adapter.weight_name} if adapter.weight_name else {"use_safetensors": True}
        try:
            module.load_lora_adapter(adapter.path, **kwargs)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError.single(f"cannot load LoRA {adapter.path!r} into {target!r}: {first}",
                                   f"model.adapters.{slot}.path") from None
    for target in {adapter_target(spec, slot) for slot in spec.model.adapters}:
        modules[target].disable_adapters()
