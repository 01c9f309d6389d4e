"""LoRA files: found and checked before any weight loads, read through the family pipeline's own converter, checked
against the module they go into, then loaded with diffusers' PEFT integration.

A LoRA file is a user's input like any other: a ``.safetensors`` file (or one in a folder, or in a Hub repository)
whose header is validated before a tensor is read; a pickled file is refused by name. After diffusers' converter
(``lora_state_dict``: kohya/ComfyUI, XLabs and the model authors' layouts) every key must be a LoRA part (an up or
down matrix, a bias, an alpha, a DoRA magnitude, a LoKr factor) of a module of the target, every matrix must fit
it and every value must be floating point and finite, or the slot is refused naming the first problem, so a wrong
file is one clear error instead of a traceback from the converter or peft, a silently ignored key or a black image.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..log import logger
from ..spec import PipelineSpec, SpecError
from ..spec.errors import first_line
from ..spec.files import PICKLE_SUFFIXES, path_kind, refuse_pickle, safetensors_header, user_path
from ..spec.hub import check_reachable, hub_offline, hub_path_problem, is_hub_id

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
# A key of a LoRA state dict in peft's names (what load_lora_adapter loads): an up or down matrix (or its bias) of a
# module, with an optional adapter name; an alpha; a DoRA magnitude; a LoKr factor.
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?:(?P<part>lora_A|lora_B|lora_down|lora_up)(?:\.[^.]+)?\.(?P<kind>weight|bias)"
                       r"|alpha|lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?|lokr_(?:w1|w2)(?:_a|_b)?|lokr_t2)$")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass
class AdapterState:
    """A pipeline's LoRA slots as changed since build: scales set by the RL side's ``scale_lora``, and ``off`` while
    the KL reference runs (its ``reference``). Phases switch slots by it, not by the spec alone."""

    scales: dict[str, float] = field(default_factory=dict)
    off: bool = False


def adapter_target(spec: PipelineSpec, slot: str) -> str:
    """The component a LoRA slot loads into: its ``target``, else the denoiser of the first phase using it."""
    adapter = spec.model.adapters[slot]
    if adapter.target:
        return adapter.target
    users = [p.denoiser for p in spec.recipe.phases if p.adapter == slot]
    return users[0] if users else spec.recipe.phases[0].denoiser


# ---- finding and checking the files (before any weight loads) ---------------------------------------------------

def lora_file(path: str, weight_name: str | None, where: str, trusted: bool = False) -> Path:
    """The local ``.safetensors`` file a LoRA reference names, its header checked: a file, ``weight_name`` in a folder
    (or the folder's one LoRA file), or that file in a Hub repository (from the cache, else downloaded; refused at
    once when the Hub can't be reached)."""
    local = user_path(path)
    if path_kind(local) == "dir":
        file = local / weight_name if weight_name else _only_weights(local, where)
    elif not is_hub_id(path):
        file = local
    else:
        file = _hub_file(path, weight_name or DEFAULT_WEIGHT_NAME, where)
    refuse_pickle(file, where, trusted)
    if file.suffix != ".safetensors":
        raise SpecError.single(f"{file}: a LoRA is read from a .safetensors file (got {file.suffix or 'no suffix'})",
                               where)
    safetensors_header(file, where)
    return file


def _only_weights(folder: Path, where: str) -> Path:
    """A folder's LoRA file: diffusers' default name, else its one ``.safetensors`` file."""
    if path_kind(folder / DEFAULT_WEIGHT_NAME) == "file":
        return folder / DEFAULT_WEIGHT_NAME
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if found:
        raise SpecError.single(f"{folder} holds {len(found)} .safetensors files ({', '.join(f.name for f in found[:4])}"
                               "); name one (--lora DIR:FILE, or weight_name)", where)
    pickles = sorted(p.name for p in folder.iterdir() if p.name.lower().endswith(PICKLE_SUFFIXES))
    more = f" (only pickled weights: {', '.join(pickles[:4])}, which omnispec does not load)" if pickles else ""
    raise SpecError.single(f"{folder} holds no .safetensors LoRA file{more}", where)


def _hub_file(repo: str, name: str, where: str) -> Path:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    if problem := hub_path_problem(name):
        raise SpecError.single(f"LoRA {repo!r}: {problem}", where)
    cached = try_to_load_from_cache(repo, name)
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline():
        raise SpecError.single(f"LoRA {repo!r} ({name}) is not in the local Hub cache and HF_HUB_OFFLINE is set: give "
                               "a local file, or unset HF_HUB_OFFLINE to download it", where)
    check_reachable(repo, where, "a local LoRA file (--lora PATH)")
    try:
        return Path(hf_hub_download(repo, name))
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        first = first_line(exc) or type(exc).__name__
        raise SpecError.single(f"cannot fetch LoRA {repo!r} ({name}): {first}", where) from None


def adapter_files(spec: PipelineSpec, trusted: bool = False) -> dict[str, Path]:
    """Every adapter slot's file, found and header-checked (no tensor read)."""
    return {slot: lora_file(adapter.path, adapter.weight_name, f"model.adapters.{slot}.path", trusted)
            for slot, adapter in spec.model.adapters.items()}


# ---- loading -------------------------------------------------------------------------------------------------

def load_adapter_slots(spec: PipelineSpec, modules: dict[str, Any], pipeline_class: type | None,
                       files: Mapping[str, Path]) -> None:
    """Load every LoRA slot with diffusers' PEFT integration, all switched off; phases switch their slots on as
    they start. Each file is read through the family pipeline's ``lora_state_dict`` (when it has one), which
    converts the layouts users have, with their ``alpha`` scales, as ``load_lora_weights`` would."""
    for slot, adapter in spec.model.adapters.items():
        target = adapter_target(spec, slot)
        module = modules[target]
        where = f"model.adapters.{slot}.path"
        if not hasattr(module, "load_lora_adapter"):
            raise SpecError.single(f"component {target!r} ({type(module).__name__}) cannot take LoRA adapters", where)
        file = files[slot]
        try:
            state, kwargs = lora_state(pipeline_class, file.parent, file.name)
        except Exception as exc:  # noqa: BLE001 - diffusers' converters fail on a bad file with any error type
            raise SpecError.single(f"cannot read LoRA {file}: {_first_line(exc)}", where) from None
        check_lora_state(state, module, kwargs.get("prefix"), f"LoRA {file} ({target})", where)
        try:
            module.load_lora_adapter(state, adapter_name=slot, **kwargs)
        except Exception as exc:  # noqa: BLE001 - peft's config inference over the file's keys, likewise
            raise SpecError.single(f"cannot load LoRA {file} into {target!r}: {_first_line(exc)}", where) from None
        logger.info(f"LoRA {slot}: {adapter.path} into {target} at scale {adapter.scale:g}"
                    + (" in every phase" if adapter.always else ""))
    for target in {adapter_target(spec, slot) for slot in spec.model.adapters}:
        modules[target].disable_adapters()


def _first_line(exc: BaseException) -> str:
    line = first_line(exc)
    return f"{line} ({type(exc).__name__})" if line else type(exc).__name__


def lora_state(pipeline_class: type | None, path: Any, weight_name: str | None = None) -> tuple[Any, dict[str, Any]]:
    """What ``load_lora_adapter`` takes for a LoRA file (a folder and the file's name) or a state dict in memory: the
    state dict converted by the family pipeline's ``lora_state_dict``, with the key prefix it carries, its ``alpha``
    scales and its metadata. Only the denoiser's part is kept (a LoRA's text-encoder part is reported and left
    out). Files are read as safetensors only (``use_safetensors=True`` also stops diffusers' pickle fallback)."""
    loader = getattr(pipeline_class, "lora_state_dict", None)
    if loader is None:
        if isinstance(path, Mapping):
            return dict(path), {"prefix": None}
        from safetensors.torch import load_file

        return load_file(str(Path(path) / weight_name) if weight_name else str(path)), {"prefix": None}
    options: dict[str, Any] = {"return_lora_metadata": True}
    if not isinstance(path, Mapping):
        options |= {"use_safetensors": True, **({"weight_name": weight_name} if weight_name else {})}
        path = str(path)
    else:
        path = dict(path)  # the loaders convert in place
    takes_alphas = "return_alphas" in inspect.signature(loader).parameters
    result = loader(path, return_alphas=True, **options) if takes_alphas else loader(path, **options)
    state, alphas, metadata = (result[0], result[1] if takes_alphas else None, result[-1]) \
        if isinstance(result, tuple) else (result, None, None)
    prefix = getattr(pipeline_class, "transformer_name", "transformer")
    if state and all(key.startswith("text_encoder") for key in state):  # a text-encoder LoRA only
        logger.warning(f"LoRA {path if isinstance(path, str) else '(in memory)'}: it has a text-encoder part only, "
                       "which omnispec does not load (a LoRA goes into the denoiser)")
        return {}, {"prefix": None, "metadata": metadata, "network_alphas": None}
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


def check_lora_state(state: Mapping[str, Any], module: torch.nn.Module, prefix: str | None, what: str,
                     where: str) -> None:
    """Every value a floating-point tensor without NaN or infinity, every key a LoRA part of a module of ``module``
    and every matrix fitting it; refused naming the first key that is not (the module, and both shapes)."""
    if not state:
        raise SpecError.single(f"{what}: no LoRA weights for this model (after conversion, no key is for the "
                               "denoiser)", where)
    ranks: dict[str, int] = {}
    for key, value in state.items():
        problem = _value_problem(value)
        if problem is None:
            problem = _key_problem(module, _peft_name(key, prefix), tuple(value.shape), ranks)
        if problem:
            raise SpecError.single(f"{what}: {key}: {problem}", where)


def _value_problem(value: Any) -> str | None:
    """What is wrong with a LoRA tensor's values: not a tensor, not floating point, NaN or infinity (fp8 and other
    narrow floats checked through a float32 copy)."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if not value.is_floating_point():
        return f"holds {str(value.dtype).removeprefix('torch.')} values; LoRA weights are floating point"
    values = value if value.dtype in _FLOAT_DTYPES else value.float()
    return None if bool(torch.isfinite(values).all()) else "holds NaN or infinite values"


def _peft_name(key: str, prefix: str | None) -> str:
    """A key as ``load_lora_adapter`` will name it: without the component prefix, old diffusers names
    (``to_q.lora.down``) in peft's (``to_q.lora_A``)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    name = key.removeprefix(f"{prefix}.") if prefix else key
    return next(iter(convert_unet_state_dict_to_peft({name: None})))


def _key_problem(module: torch.nn.Module, name: str, shape: tuple[int, ...], ranks: dict[str, int]) -> str | None:
    """Why ``name`` is not a LoRA part of a module of ``module`` (or its matrix does not fit it), or None."""
    match = _LORA_KEY.match(name)
    if match is None:
        return ("not a LoRA weight (expected a module's lora_A/lora_B or lora_down/lora_up weight or bias, its "
                "alpha, a DoRA magnitude or a LoKr factor)")
    if match["part"] and match["kind"] == "weight":
        return _fit(module, match["module"], match["part"], shape, ranks)
    try:
        module.get_submodule(match["module"])
    except AttributeError:
        return f"names no module of {type(module).__name__} ({match['module']!r} is not one of its layers)"
    return None


def _fit(module: torch.nn.Module, path: str, part: str, shape: tuple[int, ...], ranks: dict[str, int]) -> str | None:
    try:
        layer = module.get_submodule(path)
    except AttributeError:
        return f"names no module of {type(module).__name__} ({path!r} is not one of its layers)"
    base = getattr(layer, "base_layer", layer)  # a layer that already carries an adapter
    down = part in ("lora_A", "lora_down")
    if isinstance(base, torch.nn.Linear):
        expected = (None, base.in_features) if down else (base.out_features, None)
    elif isinstance(base, torch.nn.Conv2d | torch.nn.Conv3d | torch.nn.Conv1d):
        expected = (None, base.in_channels) if down else (base.out_channels, None)
    else:
        return f"{path!r} is a {type(base).__name__}, which a LoRA cannot adapt"
    if len(shape) < 2:
        return f"shape {shape} is not a matrix"
    rank = shape[0] if down else shape[1]
    known = ranks.setdefault(path, rank)
    if (expected[0] is not None and shape[0] != expected[0]) or (expected[1] is not None and shape[1] != expected[1]):
        layer_shape = (base.out_features, base.in_features) if isinstance(base, torch.nn.Linear) else \
            tuple(base.weight.shape[:2])
        return (f"shape {shape} does not fit {path!r} (weight {layer_shape}: a "
                f"{'down' if down else 'up'} matrix must be {_expected_text(expected)})")
    if rank != known:
        return f"rank {rank} differs from the rank {known} of the other matrix of {path!r}"
    return None


def _expected_text(expected: tuple[int | None, int | None]) -> str:
    return "(" + ", ".join("rank" if d is None else str(d) for d in expected) + ")"


__all__ = ["adapter_files", "adapter_target", "check_lora_state", "load_adapter_slots", "lora_file", "lora_state"]
