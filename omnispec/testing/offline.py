"""Any bundled spec, offline: a tiny random checkpoint of its family in its real layout, and the overrides that size
its recipe down to it.

``tiny_checkpoint("flux1-dev", folder)`` returns ``(path, overrides)``; ``omnispec.build("flux1-dev", source=path,
overrides=overrides)`` then runs the bundled spec unchanged but for its sizes and dtype, through the same loading,
checks and loop as the real checkpoint (``docs/offline.md``). The weights are random: outputs are noise, but every
code path a real run takes is taken. Checkpoints are built once per folder and reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..spec import SpecError, load_spec
from . import fixtures, fixtures_flux3, fixtures_krea2  # noqa: F401 - their TINY_OVERRIDES entries

# Per bundled spec with a real checkpoint: the builder, its keyword arguments, and the TINY_OVERRIDES key.
_TINY: dict[str, tuple[str, dict[str, Any], str, tuple[str, ...]]] = {
    "flux1-dev": ("tiny_flux", {}, "flux", ()),
    "flux1-schnell": ("tiny_flux", {"guidance_embeds": False}, "flux", ()),
    "flux1-dev-img2img": ("tiny_flux", {}, "flux", ()),
    "flux1-fill-dev": ("tiny_flux", {"fill": True}, "flux", ()),
    "flux1-kontext-dev": ("tiny_flux", {}, "flux", ("model.options.auto_resize=false", "model.options.max_area=1024")),
    "flux2-klein-4b": ("tiny_flux2_klein", {"distilled": True}, "flux2_klein", ()),
    "flux2-klein-4b-edit": ("tiny_flux2_klein", {"distilled": True}, "flux2_klein", ()),
    "flux2-klein-base-4b": ("tiny_flux2_klein", {}, "flux2_klein", ()),
    "sd3.5-medium": ("tiny_sd3", {}, "sd3", ("recipe.phases.0.guidance.terms.1.layers=[1, 2]",)),
    "wan2.1-t2v-1.3b": ("tiny_wan", {}, "wan", ()),
    "wan2.2-t2v-a14b": ("tiny_wan", {"two_experts": True}, "wan", ()),
    "wan2.2-ti2v-5b": ("tiny_wan_ti2v", {}, "wan", ()),
    "wan2.2-ti2v-5b-i2v": ("tiny_wan_ti2v", {}, "wan", ()),
    "wan2.1-i2v-14b-480p": ("tiny_wan_i2v", {}, "wan_i2v", ()),
    "wan2.1-vace-1.3b": ("tiny_wan_vace", {}, "wan", ()),
    "wan2.1-vace-14b": ("tiny_wan_vace", {}, "wan", ()),
    "wan2.1-vace-1.3b-r2v": ("tiny_wan_vace", {}, "wan", ()),
    "wan2.2-i2v-a14b": ("tiny_wan_i2v", {"two_experts": True}, "wan22_i2v", ()),
    "ltx2-t2v": ("tiny_ltx2", {}, "ltx2", ("recipe.phases.0.guidance.terms.1.layers=[1]",)),
    "ltx2-i2v": ("tiny_ltx2", {}, "ltx2", ("recipe.phases.0.guidance.terms.1.layers=[1]",)),
    "ltx2.3-t2v": ("tiny_ltx2", {"bwe": True}, "ltx2", ("recipe.phases.0.guidance.terms.1.layers=[1]",)),
    "qwen-image": ("tiny_qwen_image", {}, "qwen_image", ()),
    "qwen-image-inpaint": ("tiny_qwen_image", {}, "qwen_image", ()),
    "z-image-turbo": ("tiny_z_image", {}, "z_image", ()),
    "hunyuanvideo-1.5-t2v": ("tiny_hunyuan_video15", {}, "hunyuan_video15", ()),
    "hunyuanvideo-1.5-i2v": ("tiny_hunyuan_video15", {"i2v": True}, "hunyuan_video15_i2v", ()),
    "flux2-dev": ("tiny_flux2", {}, "flux2", ()),
    "flux2-dev-edit": ("tiny_flux2", {}, "flux2", ()),
    "kandinsky6-distill-t2v": ("tiny_kandinsky6", {}, "kandinsky6", ()),
    "kandinsky6-distill-i2v": ("tiny_kandinsky6", {}, "kandinsky6", ()),
    "kandinsky6-sr": ("tiny_kandinsky6_sr", {}, "kandinsky6_sr", ()),
    "ltx2.5-t2v": ("tiny_ltx25", {}, "ltx25", ()),
    "ltx2.5-i2v": ("tiny_ltx25", {}, "ltx25", ()),
    "krea2-raw": ("tiny_krea2", {}, "krea2", ()),
    "qwen-image-2.1": ("tiny_qwen_image21", {}, "qwen_image21", ()),
    "qwen-image-2.1-edit": ("tiny_qwen_image21", {}, "qwen_image21_edit", ()),
    "qwen-image-2.1-turbo": ("tiny_qwen_image21", {"turbo": True}, "qwen_image21", ()),
    "qwen-image-2.1-turbo-edit": ("tiny_qwen_image21", {"turbo": True}, "qwen_image21_edit", ()),
    "minimax-h3-t2v": ("tiny_minimax_h3", {}, "minimax_h3", ()),
    "minimax-h3-fl2va": ("tiny_minimax_h3", {}, "minimax_h3", ()),
    "flux3-klein": ("tiny_flux3", {"distilled": True}, "flux3", ()),
    "flux3-klein-edit": ("tiny_flux3", {"distilled": True}, "flux3_edit", ()),
    "flux3-klein-base": ("tiny_flux3", {}, "flux3", ()),
    "minimax-h3-ref2va": ("tiny_minimax_h3", {}, "minimax_h3_ref2va", ()),
}
TINY_SPECS = tuple(_TINY)


def tiny_checkpoint(spec: str | os.PathLike[str], folder: str | os.PathLike[str]) -> tuple[Path, list[str]]:
    """A tiny checkpoint for bundled spec ``spec`` (a name, or a path to a bundled spec's file) in ``folder`` (built
    there once, reused after), and the overrides its recipe needs to run on it."""
    name = Path(str(spec)).name.removesuffix(".yaml").removesuffix(".yml")
    if name not in _TINY:
        raise SpecError.single(f"no tiny checkpoint for {name!r}; there are: {', '.join(TINY_SPECS)}", "spec")
    builder, kwargs, key, extra = _TINY[name]
    label = builder.removeprefix("tiny_") + "".join(f"-{k}-{v}" for k, v in sorted(kwargs.items()))
    root = Path(folder) / label
    if not any((root / index).exists() for index in ("model_index.json", "modular_model_index.json")):
        from .. import testing  # every builder, whichever fixtures module holds it

        getattr(testing, builder)(root, **kwargs)
    overrides = [*fixtures.TINY_OVERRIDES[key], *extra]
    load_spec(name, overrides)  # the bundled spec runs on it as it is, but for these
    return root, overrides


__all__ = ["TINY_SPECS", "tiny_checkpoint"]
