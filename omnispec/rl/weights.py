"""Weight sync in memory: full denoiser weights from ``(name, tensor)`` pairs, PEFT LoRA adapters added,
replaced or scaled by name, and the reference model (adapters off) for KL. Every change bumps
``pipe.weight_version``, which invalidates the prompt-embedding cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from ..spec import SpecError

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline


def _denoiser(pipe: Pipeline, component: str | None) -> torch.nn.Module:
    name = component or pipe.spec.recipe.phases[0].denoiser
    if name not in pipe.components:
        raise SpecError.single(f"no component {name!r}", "component")
    return pipe.components[name]


def update_weights(pipe: Pipeline, named: Iterable[tuple[str, torch.Tensor]], component: str | None = None) -> int:
    """Copy tensors into the named parameters/buffers (shapes must match); returns how many were set."""
    module = _denoiser(pipe, component)
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            if name not in own:
                raise SpecError.single(f"{type(module).__name__} has no parameter or buffer {name!r}", "weights")
            if own[name].shape != tensor.shape:
                raise SpecError.single(f"{name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}", "weights")
            own[name].copy_(tensor.to(own[name].device, own[name].dtype))
            count += 1
    pipe.weight_version += 1
    return count


def set_lora(pipe: Pipeline, name: str, state_dict: Mapping[str, torch.Tensor], scale: float = 1.0,
             component: str | None = None, metadata: Mapping[str, object] | None = None) -> None:
    """Add (or replace) LoRA adapter ``name`` from a PEFT/diffusers state dict and make it active.
    ``metadata`` is the LoRA config (``r``, ``lora_alpha``, ``target_modules`` ...) when the state dict
    alone doesn't say it."""
    module = _denoiser(pipe, component)
    if name in getattr(module, "peft_config", {}):
        module.delete_adapters(name)
    kwargs = {"metadata": dict(metadata)} if metadata else {}
    module.load_lora_adapter(dict(state_dict), adapter_name=name, prefix=None, **kwargs)
    module.set_adapters([name], weights=[scale])
    pipe.weight_version += 1


def scale_lora(pipe: Pipeline, name: str, scale: float, component: str | None = None) -> None:
    module = _denoiser(pipe, component)
    if name not in getattr(module, "peft_config", {}):
        raise SpecError.single(f"no LoRA adapter {name!r} (have: {list(getattr(module, 'peft_config', {}))})", "lora")
    module.set_adapters([name], weights=[scale])
    pipe.weight_version += 1


@contextlib.contextmanager
def reference(pipe: Pipeline, component: str | None = None) -> Iterator[None]:
    """The reference policy: the denoiser with every adapter disabled, for KL terms."""
    module = _denoiser(pipe, component)
    has_adapters = bool(getattr(module, "peft_config", None))
    if has_adapters:
        module.disable_adapters()
    try:
        yield
    finally:
        if has_adapters:
            module.enable_adapters()
