"""Family adapters by name. A spec's ``model.family`` is one of these or a trusted 'pkg.module:Class'."""

from __future__ import annotations

import importlib

from ...log import harmless_messages_demoted
from ...spec import BUILTIN_FAMILIES, SpecError
from .base import Family
from .checks import CheckpointMatch, Inputs, checkpoint_pipelines
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams, batch_of, cat_streams

_BUILTIN = {
    "flux": "omnispec.runtime.families.flux:FluxFamily",
    "flux_kontext": "omnispec.runtime.families.flux_kontext:FluxKontextFamily",
    "flux_fill": "omnispec.runtime.families.flux_fill:FluxFillFamily",
    "flux2_klein": "omnispec.runtime.families.flux2_klein:Flux2KleinFamily",
    "sd3": "omnispec.runtime.families.sd3:SD3Family",
    "wan": "omnispec.runtime.families.wan:WanFamily",
    "wan_i2v": "omnispec.runtime.families.wan_i2v:WanImageToVideoFamily",
    "wan_ti2v": "omnispec.runtime.families.wan_ti2v:WanTI2VFamily",
    "wan_vace": "omnispec.runtime.families.wan_vace:WanVACEFamily",
    "ltx2": "omnispec.runtime.families.ltx2:LTX2Family",
    "ltx2_condition": "omnispec.runtime.families.ltx2:LTX2ConditionFamily",
    "digits": "omnispec.runtime.families.digits:DigitsFamily",
    "qwen_image": "omnispec.runtime.families.qwen_image:QwenImageFamily",
    "qwen_image_edit": "omnispec.runtime.families.qwen_image:QwenImageEditFamily",
    "qwen_image_edit_plus": "omnispec.runtime.families.qwen_image:QwenImageEditPlusFamily",
    "qwen_image_inpaint": "omnispec.runtime.families.qwen_image:QwenImageInpaintFamily",
    "z_image": "omnispec.runtime.families.z_image:ZImageFamily",
    "hunyuan_video15": "omnispec.runtime.families.hunyuan_video15:HunyuanVideo15Family",
    "hunyuan_video15_i2v": "omnispec.runtime.families.hunyuan_video15:HunyuanVideo15ImageToVideoFamily",
    "flux2": "omnispec.runtime.families.flux2:Flux2Family",
    "kandinsky6": "omnispec.runtime.families.kandinsky6:Kandinsky6Family",
    "ltx25": "omnispec.runtime.families.ltx25:LTX25Family",
    "ltx25_condition": "omnispec.runtime.families.ltx25:LTX25ConditionFamily",
    "ltx25_ic": "omnispec.runtime.families.ltx25:LTX25InContextFamily",
    "krea2": "omnispec.runtime.families.krea2:Krea2Family",
    "qwen_image21": "omnispec.runtime.families.qwen_image21:QwenImage21Family",
    "minimax_h3": "omnispec.runtime.families.minimax_h3:MiniMaxH3Family",
    "flux3": "omnispec.runtime.families.flux3:Flux3Family",
    "flux3_distilled": "omnispec.runtime.families.flux3:Flux3DistilledFamily",
    "minimax_h3_ref2va": "omnispec.runtime.families.minimax_h3_ref2va:MiniMaxH3Ref2VAFamily",
    "kandinsky6_sr": "omnispec.runtime.families.kandinsky6_sr:Kandinsky6SRFamily",
}
assert tuple(_BUILTIN) == BUILTIN_FAMILIES, "spec.model.BUILTIN_FAMILIES must list the registered families"


def import_ref(ref: str) -> object:
    """Import 'pkg.module:Name' or 'pkg.Name' (the latter as an attribute of the top-level package)."""
    if ":" in ref:
        module, _, attr = ref.partition(":")
    else:
        module, _, attr = ref.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SpecError.single(f"cannot import {ref!r}: {exc}") from None
    return obj


def family_class(name: str) -> type[Family]:
    with harmless_messages_demoted():  # a family's module imports its diffusers pipelines
        cls = import_ref(_BUILTIN.get(name, name))
    if not (isinstance(cls, type) and issubclass(cls, Family)):
        raise SpecError.single(f"{name!r} is not a Family subclass", "model.family")
    return cls


__all__ = ["CheckpointMatch", "Conditioning", "Decoded", "Family", "Geometry", "Inputs", "Perturbation", "Streams",
           "batch_of", "cat_streams", "checkpoint_pipelines", "family_class", "import_ref"]
