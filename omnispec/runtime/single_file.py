"""Components from one weights file, through diffusers' single-file loader (``from_single_file``) and its converters.

A single file holds a model in its authors' key layout (Black Forest Labs', Wan's, Lightricks'), a repack's
(ComfyUI's ``model.diffusion_model.`` prefix) or diffusers' own; diffusers' converter for the class maps it to the
diffusers layout, so omnispec keeps no key tables of its own. Before any weight is read, the file's header is turned
into meta tensors of its shapes and (1) the model is recognised from its keys as diffusers' detection recognises it,
(2) the class's converter runs on those meta tensors, and (3) the converted names and shapes are compared with the
model the config describes. A file of another family, another variant or another size is refused there, naming
both; diffusers itself would fail later inside the loader (a missing weight is a "Cannot copy out of meta tensor"
error, an extra one a warning). GGUF files load through diffusers' GGUF quantizer: their blocks stay packed in
memory and each Linear dequantizes in its forward, in the component's dtype.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import bridge
from ..log import logger
from ..spec import SpecError
from ..spec.errors import first_line
from ..spec.weights_file import WeightsFile

# diffusers' detected model types, by the omnispec families a file of that type can serve.
FAMILIES_OF_TYPE = {
    "flux-dev": ("flux", "flux_kontext"), "flux-schnell": ("flux", "flux_kontext"),
    "sd3": ("sd3",), "sd35_medium": ("sd3",), "sd35_large": ("sd3",),
    "wan-t2v-1.3B": ("wan",), "wan-t2v-14B": ("wan",), "wan-t2v": ("wan",), "wan-i2v-14B": ("wan_i2v",),
    "z-image-turbo": ("z_image",), "ltx2-dev": ("ltx2", "ltx2_condition"),
    "qwen-image": ("qwen_image", "qwen_image_edit", "qwen_image_edit_plus"),
}
# Keys diffusers 0.42's detection does not look for, checked before it: Qwen-Image's files are in diffusers' layout
# (its converter is the identity) and have no detection key; an LTX-2 file also holds the key diffusers takes for
# LTX-Video, whose branch runs first, so diffusers calls every LTX-2 file LTX-Video.
_OWN_DETECTION = (("qwen-image", ("txt_norm.weight", "img_in.weight", "transformer_blocks.0.img_mod.1.weight")),
                  ("ltx2-dev", ("av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight",)))
_PREFIXES = ("", "model.diffusion_model.")
# The last name part of the tensors ComfyUI's quantized files add beside each weight: "scaled fp8" (scale_weight,
# scale_input, a scaled_fp8 marker) and its later per-layer layout (weight_scale, weight_scale_2 for nvfp4,
# input_scale, comfy_quant); diffusers 0.42's converters drop them all.
COMFY_QUANTIZATION_NAMES = frozenset({"scale_weight", "scale_input", "scaled_fp8", "weight_scale", "weight_scale_2",
                                      "input_scale", "comfy_quant"})


@dataclass(frozen=True)
class Detected:
    """What a file is: diffusers' model type (``flux-dev``, ``wan-t2v-1.3B`` ...) or None when nothing matched."""

    model_type: str | None

    @property
    def families(self) -> tuple[str, ...]:
        return FAMILIES_OF_TYPE.get(self.model_type or "", ())

    def describe(self) -> str:
        return self.model_type or "no model diffusers recognises"


def meta_checkpoint(weights: WeightsFile) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors of their shapes (a GGUF block type's logical shape): what detection and a
    converter need, with no data read."""
    out = {}
    for key, stored in weights.tensors.items():
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(stored.dtype, torch.float32)
        out[key] = torch.empty(stored.shape, dtype=dtype, device="meta")
    return out


def detect(weights: WeightsFile) -> Detected:
    """The file's model type, from its keys and shapes, as diffusers' ``infer_diffusers_model_type`` decides it,
    with the two families it misses checked first, and Wan's text-to-video / image-to-video told apart by the image
    conditioning a Wan file has or lacks (diffusers calls every Wan width but 1.3B and 14B text-to-video
    ``wan-i2v-14B``)."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, infer_diffusers_model_type

    keys = set(weights.tensors)
    for model_type, needed in _OWN_DETECTION:
        if any(all(prefix + key in keys for key in needed) for prefix in _PREFIXES):
            return Detected(model_type)
    checkpoint = meta_checkpoint(weights)
    try:
        found = infer_diffusers_model_type(checkpoint)
    except Exception:  # noqa: BLE001 - a branch that reads values (meta tensors have none): not recognised
        return Detected(None)
    if found == "v1" and CHECKPOINT_KEY_NAMES["v1"] not in keys:  # diffusers' fallback when nothing matched
        return Detected(None)
    if found == "wan-i2v-14B":
        prefix = next((p for p in _PREFIXES if f"{p}patch_embedding.weight" in keys), "")
        image = any(k.startswith(f"{prefix}img_emb.") for k in keys)
        in_channels = weights.tensors[f"{prefix}patch_embedding.weight"].shape[1] if \
            f"{prefix}patch_embedding.weight" in keys else 0
        if not image and in_channels == 16:
            width = weights.tensors[f"{prefix}patch_embedding.weight"].shape[0]
            found = {1536: "wan-t2v-1.3B", 5120: "wan-t2v-14B"}.get(width, "wan-t2v")
    return Detected(found)


def loadable_entry(cls: type, where: str) -> dict[str, Any]:
    """diffusers' single-file table entry for ``cls`` (its converter from the original layout, its default
    subfolder), found as ``from_single_file`` finds it; a class without one is refused, naming why."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    for name, entry in SINGLE_FILE_LOADABLE_CLASSES.items():
        base = getattr(diffusers, name, None)
        if isinstance(base, type) and issubclass(cls, base):
            return entry
    if not cls.__module__.startswith("diffusers"):
        raise SpecError.single(f"{cls.__name__} cannot load from one weights file: single files are diffusers' "
                               "models' (transformers' text encoders load from their folder)", where)
    raise SpecError.single(f"{cls.__name__} cannot load from one weights file: diffusers "
                           f"{diffusers.__version__} has no converter from an original layout for it; load it from a "
                           "diffusers folder", where)


def refuse_scaled(weights: WeightsFile, where: str) -> None:
    """Refuse a ComfyUI quantized file: each weight is stored divided by a scale tensor beside it, which diffusers'
    converters drop, so the model would load wrong (and silently: the scales are only 'left out')."""
    scaled = sorted(k for k in weights.tensors if k.rsplit(".", 1)[-1] in COMFY_QUANTIZATION_NAMES)
    if scaled:
        raise SpecError.single(f"{weights.path.name} is a ComfyUI 'scaled fp8' file or another quantized "
                               f"layout ({scaled[0]} and {len(scaled) - 1} more): its weights are stored divided by "
                               "per-layer scales that diffusers' converter does not apply, so the model would load "
                               "wrong; use the authors' file, a plain bf16/fp8 one, or a GGUF", where)


def check_file(cls: type, weights: WeightsFile, config: dict[str, Any], family: str | None, role: str,
               where: str) -> Detected:
    """Refuse, before any weight loads, a file that is not the model ``config`` describes: another family (for a
    denoiser), keys the converter cannot map, weights the model needs and the file lacks, shapes that differ."""
    refuse_scaled(weights, where)
    detected = detect(weights) if role == "denoiser" else Detected(None)
    if family is not None and detected.families and family not in detected.families:
        raise SpecError.single(f"{weights.path.name} is a {detected.describe()} file (by its keys and shapes), not "
                               f"a {family} model's, which the spec's family is", where)
    expected = _config_shapes(cls, config, where)
    converted = _converted_shapes(cls, weights, config, expected, where)
    missing = sorted(set(expected) - set(converted))
    wrong = [(k, converted[k], expected[k]) for k in sorted(set(expected) & set(converted))
             if converted[k] != expected[k]]
    kind = f" ({detected.describe()})" if detected.model_type else ""
    if wrong:
        key, have, want = wrong[0]
        raise SpecError.single(f"{weights.path.name}{kind} does not fit the config: {key} is {list(have)} in the file "
                               f"and {list(want)} in the model the config describes ({len(wrong)} weight(s) differ; "
                               "another variant or size)", where)
    if missing:
        names = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise SpecError.single(f"{weights.path.name}{kind} lacks {len(missing)} weight(s) the model the config "
                               f"describes has: {names} (another variant, or an incomplete file)", where)
    extra = sorted(set(converted) - set(expected))
    if extra:
        logger.info(f"{weights.path.name}: {len(extra)} tensor(s) the model has no place for are left out "
                    f"({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''})")
    return detected


def _config_shapes(cls: type, config: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    from accelerate import init_empty_weights

    from .components import bounded_modules

    with bounded_modules(cls.__name__, "its config", where), init_empty_weights():
        model = cls.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _converted_shapes(cls: type, weights: WeightsFile, config: dict[str, Any],
                      expected: dict[str, tuple[int, ...]], where: str) -> dict[str, tuple[int, ...]]:
    """The file's tensors under diffusers' own conversion, run on meta tensors (converters rename, split, concatenate
    and swap halves, all of which meta tensors do without data)."""
    checkpoint = meta_checkpoint(weights)
    if not bridge.single_file_needs_conversion(expected, checkpoint):
        return {k: tuple(v.shape) for k, v in checkpoint.items()}
    convert = loadable_entry(cls, where)["checkpoint_mapping_fn"]
    accepted = inspect.signature(convert).parameters
    kwargs = {"config": config} if "config" in accepted or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()) else {}
    try:
        converted = convert(checkpoint=checkpoint, **kwargs)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError, AttributeError) as exc:
        first = first_line(exc) or type(exc).__name__
        raise SpecError.single(f"{weights.path.name} is not in a layout diffusers' {convert.__name__} reads "
                               f"({type(exc).__name__}: {first[:160]}); is it another model's file?", where) from None
    return {k: tuple(v.shape) for k, v in converted.items() if isinstance(v, torch.Tensor)}


def load(cls: type, path: Path, weights: WeightsFile, config_root: str | None, subfolder: str | None,
         dtype: torch.dtype, extra: dict[str, Any], revision: str | None) -> torch.nn.Module:
    """``cls`` from the file through ``from_single_file``: the config from ``config_root``/``subfolder`` (a local
    folder or a Hub id) when given, diffusers' default for the detected model otherwise; GGUF through diffusers'
    GGUF quantizer computing in ``dtype``."""
    kwargs: dict[str, Any] = {"torch_dtype": dtype, **extra}
    if config_root is not None:
        kwargs |= {"config": config_root, "subfolder": subfolder}
        if revision:
            kwargs["config_revision"] = revision
    if weights.format == "gguf":
        from diffusers import GGUFQuantizationConfig

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
    return cls.from_single_file(str(path), **kwargs)


__all__ = ["COMFY_QUANTIZATION_NAMES", "Detected", "check_file", "detect", "load", "loadable_entry", "meta_checkpoint",
           "refuse_scaled"]
