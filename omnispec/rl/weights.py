"""Weight sync in memory: full denoiser weights from ``(name, tensor)`` pairs, PEFT LoRA adapters added,
replaced or scaled by name, and the reference model (adapters off) for KL. Every change bumps
``pipe.weight_version``, which invalidates the prompt-embedding cache.

Arguments are checked before anything changes: a wrong type raises ``SpecTypeError`` (a ``TypeError``), a
wrong value ``SpecError`` (a ``ValueError``), each naming the argument.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..spec import SpecError, SpecTypeError
from ..spec.errors import first_line

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline


def _denoiser(pipe: Pipeline, component: str | None) -> torch.nn.Module:
    from ..runtime.pipeline import Pipeline

    if not isinstance(pipe, Pipeline):
        raise SpecTypeError.single(f"expected a Pipeline (from omnispec.build), got {type(pipe).__name__}", "pipe")
    if component is not None and not isinstance(component, str):
        raise SpecTypeError.single(f"expected a component name, got {type(component).__name__}", "component")
    name = component or pipe.spec.recipe.phases[0].denoiser
    if name not in pipe.components:
        raise SpecError.single(f"no component {name!r} (have: {', '.join(pipe.components)})", "component")
    module = pipe.components[name]
    if not isinstance(module, torch.nn.Module):
        raise SpecError.single(f"component {name!r} is a {type(module).__name__}, which has no weights", "component")
    return module


def _adapter_name(name: Any) -> str:
    if not isinstance(name, str):
        raise SpecTypeError.single(f"expected an adapter name, got {type(name).__name__}", "name")
    if not name:
        raise SpecError.single("an adapter name cannot be empty", "name")
    return name


def _scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise SpecTypeError.single(f"expected a number, got {type(scale).__name__}", "scale")
    if not math.isfinite(scale):
        raise SpecError.single(f"expected a finite number, got {scale}", "scale")
    return float(scale)


def _tensors(named: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a mapping or an iterable of pairs."""
    if isinstance(named, Mapping):
        pairs = list(named.items())
    elif isinstance(named, (str, bytes, torch.Tensor)) or not isinstance(named, Iterable):
        raise SpecTypeError.single(f"expected (name, tensor) pairs or a mapping of name to tensor, got "
                                   f"{type(named).__name__}", where)
    else:
        pairs = list(named)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise SpecTypeError.single(f"expected a (name, tensor) pair, got {type(pair).__name__}", f"{where}.{i}")
        if not isinstance(pair[0], str):
            raise SpecTypeError.single(f"expected a parameter name, got {type(pair[0]).__name__}", f"{where}.{i}")
        if not isinstance(pair[1], torch.Tensor):
            raise SpecTypeError.single(f"{pair[0]}: expected a torch.Tensor, got {type(pair[1]).__name__}",
                                       f"{where}.{i}")
    return [(str(n), t) for n, t in pairs]


def update_weights(pipe: Pipeline, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                   component: str | None = None) -> int:
    """Copy tensors into the named parameters/buffers of the denoiser (or ``component``); returns how many were
    set. ``named`` is ``(name, tensor)`` pairs or a state dict; every name must exist with the same shape, and
    nothing is copied unless all do."""
    module = _denoiser(pipe, component)
    pairs = _tensors(named, "named")
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    for i, (name, tensor) in enumerate(pairs):
        if name not in own:
            raise SpecError.single(f"{type(module).__name__} has no parameter or buffer {name!r}", f"named.{i}")
        if own[name].shape != tensor.shape:
            raise SpecError.single(f"{name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}", f"named.{i}")
    with torch.no_grad():
        for name, tensor in pairs:
            own[name].copy_(tensor.to(own[name].device, own[name].dtype))
    pipe.weight_version += 1
    return len(pairs)


def set_lora(pipe: Pipeline, name: str, state_dict: Mapping[str, torch.Tensor], scale: float = 1.0,
             component: str | None = None, metadata: Mapping[str, object] | None = None,
             max_rank: int | None = None) -> None:
    """Add (or replace) LoRA adapter ``name`` from a PEFT/diffusers state dict and make it active at ``scale``
    (finite). ``metadata`` is the LoRA config (``r``, ``lora_alpha``, ``target_modules`` ...) when the state
    dict alone doesn't say it. Replacing an adapter swaps its weights in place (diffusers' hotswap), so a compiled
    denoiser is not recompiled; under ``policies.compile`` the first adapter is prepared for that with diffusers'
    ``enable_lora_hotswap`` at ``max_rank`` (default: this state dict's rank; later ones may not exceed it). A state
    dict that can't be swapped in place (other target modules, a larger rank) replaces the adapter instead. A state
    dict the denoiser can't take raises ``SpecError`` naming it; an adapter it replaced is then gone."""
    module = _denoiser(pipe, component)
    name = _adapter_name(name)
    scale = _scale(scale)
    if not isinstance(state_dict, Mapping):
        raise SpecTypeError.single(f"expected a mapping of name to tensor, got {type(state_dict).__name__}",
                                   "state_dict")
    state = dict(_tensors(state_dict, "state_dict"))
    if not state:
        raise SpecError.single("the state dict is empty", "state_dict")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise SpecTypeError.single(f"expected a mapping (the LoRA config), got {type(metadata).__name__}", "metadata")
    if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1):
        raise SpecError.single(f"expected a positive int, got {max_rank!r}", "max_rank")
    kwargs = {"metadata": dict(metadata)} if metadata else {}
    from ..runtime.lora import check_lora_state

    check_lora_state(state, module, None, f"{type(module).__name__} cannot take this LoRA", "state_dict")
    try:
        if name in getattr(module, "peft_config", {}):
            _replace_lora(module, name, state, kwargs)
        else:
            if pipe.spec.policies.compile.mode != "none" and not getattr(module, "peft_config", {}):
                module.enable_lora_hotswap(target_rank=max_rank or _rank(state), check_compiled="ignore")
            module.load_lora_adapter(state, adapter_name=name, prefix=None, **kwargs)
    except (ValueError, LookupError, TypeError, AttributeError, RuntimeError) as exc:  # raised by peft/diffusers
        first = first_line(exc) or type(exc).__name__
        raise SpecError.single(f"{type(module).__name__} cannot take this LoRA: {first}", "state_dict") from None
    finally:
        pipe.weight_version += 1
    _scale_in_place(module, name, scale)


def _replace_lora(module: torch.nn.Module, name: str, state: dict[str, torch.Tensor], kwargs: dict) -> bool:
    """New weights for an existing adapter: in place when they fit its layers (no new modules, so nothing compiled
    is invalidated; returns True), else the adapter is deleted and loaded again (False)."""
    from ..log import logger

    why = _unswappable(module, name, state)
    if why is None:
        try:
            module.load_lora_adapter(state, adapter_name=name, prefix=None, hotswap=True, **kwargs)
            return True
        except (ValueError, RuntimeError, KeyError) as exc:
            why = str(exc).strip().splitlines()[0]
    logger.info(f"LoRA {name!r} replaced, not swapped in place ({why}): a compiled denoiser recompiles")
    module.delete_adapters(name)
    module.load_lora_adapter(state, adapter_name=name, prefix=None, **kwargs)
    return False


def _scale_in_place(module: torch.nn.Module, name: str, scale: float) -> None:
    """Make adapter ``name`` the active one at ``scale``. After a load or a swap each layer's scaling is the adapter's
    alpha / rank; it becomes ``scale`` times that in place (a tensor scaling, as ``enable_lora_hotswap`` leaves it,
    is filled, so nothing compiled sees a new value), and the layer's alpha is kept consistent with its (padded) rank
    for later ``scale_lora`` calls."""
    from peft.tuners.lora import LoraLayer

    module.enable_adapters()
    if list(module.active_adapters()) != [name]:
        module.set_adapters([name], weights=[scale])  # another adapter was active: activate this one
    for layer in module.modules():
        if isinstance(layer, LoraLayer) and name in layer.scaling:
            current = layer.scaling[name]
            base = float(current)  # alpha / rank of the adapter just swapped in
            layer.lora_alpha[name] = base * layer.r[name]
            if isinstance(current, torch.Tensor):
                current.fill_(scale * base)
            else:
                layer.scaling[name] = scale * base


def _unswappable(module: torch.nn.Module, name: str, state: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``state`` can't be swapped into adapter ``name``'s layers (a layer it lacks, a larger rank), checked
    before the swap, which moves tensors and is not undone when it fails half way."""
    own = dict(module.named_parameters())
    for key, tensor in state.items():
        target = own.get(key.removesuffix(".weight") + f".{name}.weight") if key.endswith(".weight") else None
        if target is None:
            return f"the adapter has no layer for {key}"
        if tensor.ndim != target.ndim or any(a > b for a, b in zip(tensor.shape, target.shape)):
            return f"{key}: shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}"
    return None


def _rank(state: Mapping[str, torch.Tensor]) -> int:
    """The largest LoRA rank in a state dict (the rows of its ``lora_A`` weights)."""
    ranks = [t.shape[0] for k, t in state.items() if "lora_A" in k and t.ndim >= 2]
    return max(ranks) if ranks else 1


def scale_lora(pipe: Pipeline, name: str, scale: float, component: str | None = None) -> None:
    """Set the active weight of LoRA adapter ``name`` (an existing adapter; ``scale`` finite)."""
    module = _denoiser(pipe, component)
    name = _adapter_name(name)
    scale = _scale(scale)
    if name not in getattr(module, "peft_config", {}):
        raise SpecError.single(f"no LoRA adapter {name!r} (have: {list(getattr(module, 'peft_config', {}))})", "name")
    module.set_adapters([name], weights=[scale])
    if name in pipe.spec.model.adapters:  # a spec slot: phases switch it on at this scale from now on
        pipe.adapters.scales[name] = scale
    pipe.weight_version += 1


@contextlib.contextmanager
def reference(pipe: Pipeline, component: str | None = None) -> Iterator[None]:
    """The reference policy: the denoiser with every adapter disabled, for KL terms."""
    module = _denoiser(pipe, component)
    has_adapters = bool(getattr(module, "peft_config", None))
    if has_adapters:
        module.disable_adapters()
    was_off, pipe.adapters.off = pipe.adapters.off, True  # phases keep the spec's slots off meanwhile
    try:
        yield
    finally:
        pipe.adapters.off = was_off
        if has_adapters:
            module.enable_adapters()
