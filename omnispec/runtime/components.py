"""Load a spec's components with their classes, subfolders and dtypes, through ``from_pretrained``.

Loading goes through diffusers'/transformers' own ``from_pretrained`` so that a local directory and a
Hub id take the same path; ``check_source`` runs first so a missing checkpoint is reported before any
weight is read.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..log import logger
from ..policies import quantization
from ..spec import Component, PipelineSpec, SpecError
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
    """Resolve the checkpoint root and check the components' files are reachable, loading nothing. A component
    with its own ``source`` is checked against that root instead."""
    wanted = set(spec.model.components if names is None else names)
    root = source or spec.model.source
    if not root:
        raise SpecError.single("no checkpoint: the spec has no model.source and no --source was given", "model.source")
    by_root: dict[tuple[str, str], dict[str, Component]] = {}
    for name, component in spec.model.components.items():
        if name in wanted:
            where = (component.source, f"model.components.{name}.source") if component.source else (root, "model.source")
            by_root.setdefault(where, {})[name] = component
    resolved = _check_root(root, {}, spec.model.revision, "model.source")
    for (path, where), components in by_root.items():
        _check_root(path, components, spec.model.revision, where)
    return resolved


def _check_root(root: str, components: Mapping[str, Component], revision: str | None, where: str) -> str:
    local = Path(root).expanduser()
    if local.exists():
        if not local.is_dir():
            raise SpecError.single(f"checkpoint root {root!r} is not a directory", where)
        missing = [f"{name} ({c.subfolder})" for name, c in components.items()
                   if c.subfolder and not (local / c.subfolder).is_dir()]
        if missing:
            raise SpecError.single(f"checkpoint {root!r} lacks component folder(s): {', '.join(missing)}", where)
        return str(local)
    if root.startswith((".", "/", "~")) or root.count("/") != 1:
        raise SpecError.single(f"checkpoint {root!r} is neither a local directory nor a Hub id (owner/name)", where)
    if not hub_offline():
        unreachable = hub_unreachable()
        if unreachable:
            raise SpecError.single(
                f"{root!r} is a Hub id, and the Hugging Face Hub is unreachable from here ({unreachable}): give a "
                "local checkpoint directory with --source (source= in Python), or set HF_HUB_OFFLINE=1 to load it "
                "from the local cache", where)
    else:
        from huggingface_hub import try_to_load_from_cache

        for name, c in components.items():
            probe = f"{c.subfolder}/config.json" if c.subfolder and c.role not in _WEIGHTLESS else None
            if probe and not isinstance(try_to_load_from_cache(root, probe, revision=revision), str):
                raise SpecError.single(
                    f"Hub checkpoint {root!r} is not in the local cache (component {name!r}) and HF_HUB_OFFLINE is set: "
                    "give a local checkpoint directory with --source (source= in Python), or unset HF_HUB_OFFLINE to "
                    "download it", where)
    return root


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hub endpoint can't be reached (one quick request, once per process), or None when it answers: so
    that a Hub id without a network fails at once naming the way out, not after minutes of download retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any transport error means the same here
        return f"{constants.ENDPOINT}: {str(exc).strip() or type(exc).__name__}"
    return None


def load_components(spec: PipelineSpec, root: str, only: Mapping[str, Component] | None = None) -> dict[str, Any]:
    """The components (all, or ``only`` these), on the CPU, in their dtypes; placement is a policy step. A
    progress bar counts them (``runtime.progress``); each one's time is logged at debug level."""
    out: dict[str, Any] = {}
    wanted = only if only is not None else spec.model.components
    start = time.perf_counter()
    bar = tqdm(wanted.items(), desc="loading", unit="component", disable=not spec.runtime.progress, leave=False)
    for name, component in bar:
        bar.set_postfix_str(name)
        began = time.perf_counter()
        out[name] = _load_component(spec, root, name, component)
        logger.debug(f"loaded {name} ({component.class_}) in {time.perf_counter() - began:.1f} s")
    logger.info(f"loaded {len(out)} component(s) from {root} in {time.perf_counter() - start:.1f} s")
    return out


def _load_component(spec: PipelineSpec, root: str, name: str, component: Component) -> Any:
    cls = component_class(component)
    kwargs: dict[str, Any] = {}
    if component.subfolder:
        kwargs["subfolder"] = component.subfolder
    if spec.model.revision:
        kwargs["revision"] = spec.model.revision
    if component.role not in _WEIGHTLESS:
        kwargs["dtype"] = DTYPES[component.dtype or spec.model.dtype]
        kwargs |= quantization.load_kwargs(spec, name, component, cls)
        kwargs |= component.config
    home = component.source or root
    try:
        if component.file:
            module = cls.from_single_file(str(Path(home) / (component.subfolder or "") / component.file),
                                          **{k: v for k, v in kwargs.items() if k == "dtype"})
        else:
            module = cls.from_pretrained(home, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError.single(f"cannot load component {name!r} ({component.class_}) from {root!r}: {first}",
                               f"model.components.{name}") from None
    if isinstance(module, torch.nn.Module):
        module.eval().requires_grad_(False)
    return module


def adapter_target(spec: PipelineSpec, slot: str) -> str:
    """The component a LoRA slot loads into: its ``target``, else the denoiser of the first phase using it."""
    adapter = spec.model.adapters[slot]
    if adapter.target:
        return adapter.target
    users = [p.denoiser for p in spec.recipe.phases if p.adapter == slot]
    return users[0] if users else spec.recipe.phases[0].denoiser


def load_adapter_slots(spec: PipelineSpec, modules: dict[str, Any], pipeline_class: type | None = None) -> None:
    """Load every LoRA slot with diffusers' PEFT integration, all switched off; phases switch their slots on as
    they start. The file is read through the family pipeline's own ``lora_state_dict`` when it has one, which
    converts the layouts users have (diffusers-saved ``transformer.``-prefixed keys, kohya/ComfyUI, XLabs and the
    model authors' own formats, with their ``alpha`` scales), as ``load_lora_weights`` would."""
    for slot, adapter in spec.model.adapters.items():
        target = adapter_target(spec, slot)
        module = modules[target]
        if not hasattr(module, "load_lora_adapter"):
            raise SpecError.single(f"component {target!r} ({type(module).__name__}) cannot take LoRA adapters",
                                   f"model.adapters.{slot}")
        try:
            state, kwargs = lora_state(pipeline_class, adapter.path, adapter.weight_name)
            module.load_lora_adapter(state, adapter_name=slot, **kwargs)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError.single(f"cannot load LoRA {adapter.path!r} into {target!r}: {first}",
                                   f"model.adapters.{slot}.path") from None
        logger.info(f"LoRA {slot}: {adapter.path} into {target} at scale {adapter.scale:g}"
                    + (" in every phase" if adapter.always else ""))
    for target in {adapter_target(spec, slot) for slot in spec.model.adapters}:
        modules[target].disable_adapters()


def lora_state(pipeline_class: type | None, path: Any, weight_name: str | None = None) -> tuple[Any, dict[str, Any]]:
    """What ``load_lora_adapter`` takes for a LoRA file (or a state dict in memory): the state dict converted by
    the family pipeline's ``lora_state_dict``, with the key prefix it carries, its ``alpha`` scales and its
    metadata; or the path itself when the family's pipeline has no loader of its own. Only the denoiser's part
    is kept (a LoRA's text-encoder part is reported and left out)."""
    loader = getattr(pipeline_class, "lora_state_dict", None)
    if loader is None:
        files = {"weight_name": weight_name} if weight_name else {"use_safetensors": True}
        return path, {"prefix": None, **files}
    options: dict[str, Any] = {"return_lora_metadata": True}
    if not isinstance(path, Mapping):
        options |= {"weight_name": weight_name} if weight_name else {"use_safetensors": True}
    else:
        path = dict(path)  # the loaders convert in place
    takes_alphas = "return_alphas" in inspect.signature(loader).parameters
    result = loader(path, return_alphas=True, **options) if takes_alphas else loader(path, **options)
    state, alphas, metadata = (result[0], result[1] if takes_alphas else None, result[-1]) \
        if isinstance(result, tuple) else (result, None, None)
    prefix = getattr(pipeline_class, "transformer_name", "transformer")
    if any(key.startswith(f"{prefix}.") for key in state):
        others = sorted({key.split(".")[0] for key in state if not key.startswith(f"{prefix}.")})
        if others:
            logger.warning(f"LoRA {path if isinstance(path, str) else '(in memory)'}: its {', '.join(others)} part "
                           "is not loaded (omnispec loads a LoRA into the denoiser only)")
        state = {key: value for key, value in state.items() if key.startswith(f"{prefix}.")}
        if alphas:
            alphas = {key: value for key, value in alphas.items() if key.startswith(f"{prefix}.")}
    else:
        prefix = None
    return state, {"prefix": prefix, "metadata": metadata, "network_alphas": alphas or None}
