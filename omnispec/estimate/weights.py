"""Parameter bytes from safetensors headers, under the declared dtype and quantization, and meta-device modules."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..spec import Component, PipelineSpec, SpecError
from ..spec.files import SAFETENSORS_DTYPE_BITS, index_shards, read_json_file, safetensors_header
from ..spec.weights_file import locate, read_weights_file
from .report import ComponentBytes

_FLOATING = {"F64", "F32", "F16", "BF16"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bytes per quantized Linear weight value, and per output row of scales (fp32 per-row scales; int4's group scales
# and zero points of 128 values each; nf4's absmax per 64 values, counted per value).
_QUANT_BYTES = {"fp8_dynamic": 1.0, "fp8_weight_only": 1.0, "int8_weight_only": 1.0, "int8_dynamic": 1.0,
                "int8": 1.0, "int4_weight_only": 0.5 + 4 / 128, "nf4": 0.5 + 4 / 64}
_ROW_SCALE_BYTES = {"fp8_dynamic": 4, "fp8_weight_only": 4, "int8_weight_only": 4, "int8_dynamic": 4, "int8": 4}
STAGE_ROLES = {"encode": ("encoder",), "denoise": ("denoiser",), "decode": ("vae", "upsampler")}



# ---- parameter bytes from safetensors headers ---------------------------------------------------------------

def weight_files(folder: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` would read in a component folder (its index's shards, else the
    plain files; a variant such as ``.fp16.safetensors`` only when nothing else is there)."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        if index.name.count(".") == 3:  # diffusion_pytorch_model.safetensors.index.json, not a variant's
            return [folder / s for s in index_shards(read_json_file(index), index)]
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if f.name.count(".") == 1]
    return plain or files


def component_bytes(spec: PipelineSpec, name: str, component: Component, folder: Path,
                    meta_module: torch.nn.Module | None, root: str | Path = "") -> ComponentBytes:
    """What a component's weights take: on disk (``stored``) and once loaded in the spec's dtype and quantization
    (``loaded``), from its safetensors headers (a folder's, or its single file's, GGUF included: packed blocks
    count their own bytes), else from its config's meta module."""
    dtype_bytes = _DTYPE_BYTES[component.dtype or spec.model.dtype]
    quant = spec.policies.quantization.get(name) or spec.policies.quantization.get(component.role)
    linear = _linear_weights(meta_module, quant.exclude) if quant is not None and meta_module is not None else {}
    tensors: dict[str, tuple[str, list[int]]] = {}
    packed: dict[str, int] = {}  # GGUF block-quantized tensors: their bytes, which stay packed when loaded
    how = "safetensors header"
    if component.file is not None:
        where = f"model.components.{name}.file"
        path = locate(component, str(root), where, spec.model.revision, fetch=False)
        if path is None:
            raise SpecError.single(f"{component.file} is a Hub file that is not in the local cache; the estimate "
                                   "reads its header from disk", where)
        weights = read_weights_file(path, where)
        how = f"{weights.format} header"
        for key, stored in weights.tensors.items():
            tensors[key] = (stored.dtype, list(stored.shape))
            if stored.quantized:
                packed[key] = stored.nbytes
    for path in weight_files(folder) if component.file is None else []:
        for key, entry in safetensors_header(path, f"model.components.{name}").tensors.items():
            tensors[key] = (entry.dtype, list(entry.shape))
    if not tensors:
        if meta_module is None:
            raise SpecError.single(f"component {name!r}: no safetensors files in {folder} and no config to count from",
                                   f"model.components.{name}")
        how = "config (meta)"
        tensors = {k: ("F32" if v.is_floating_point() else "I64", list(v.shape))
                   for k, v in meta_module.state_dict().items()}
    params = stored = loaded = 0
    blocks: dict[str, int] = {}
    for key, (dtype, shape) in tensors.items():
        count = math.prod(shape)
        params += count
        stored += packed[key] if key in packed else count * SAFETENSORS_DTYPE_BITS.get(dtype, 32) // 8
        if key in packed:
            size = packed[key]
        elif key in linear:
            size = int(count * _QUANT_BYTES[quant.method]) + shape[0] * _ROW_SCALE_BYTES.get(quant.method, 0)
        elif dtype in _FLOATING:
            size = count * dtype_bytes
        else:
            size = count * SAFETENSORS_DTYPE_BITS.get(dtype, 32) // 8
        loaded += size
        block = _block_of(key)
        if block is not None:
            blocks[block] = blocks.get(block, 0) + size
    if meta_module is not None and how == "safetensors header":  # buffers no file holds (position ids ...)
        saved = set(meta_module.state_dict())
        loaded += sum(b.numel() * b.element_size() for n, b in meta_module.named_buffers() if n not in saved)
    return ComponentBytes(name, component.role, params, stored, loaded, how, blocks)


def _linear_weights(module: torch.nn.Module, exclude: list[str]) -> set[str]:
    """Weight names of the Linear layers a quantizer converts (``exclude`` matched as diffusers matches
    ``modules_to_not_convert``)."""
    return {f"{fqn}.weight" for fqn, child in module.named_modules() if isinstance(child, torch.nn.Linear)
            and not any(f"{entry}." in f"{fqn}." for entry in exclude)}


def _block_of(key: str) -> str | None:
    """``transformer_blocks.3`` for ``transformer_blocks.3.attn.to_q.weight``: a repeated block of the top-level
    module, which group offloading moves as a unit."""
    parts = key.split(".")
    return f"{parts[0]}.{parts[1]}" if len(parts) > 2 and parts[1].isdigit() else None


# ---- meta modules -------------------------------------------------------------------------------------------

def config_module(cls: type, folder: Path, dtype: torch.dtype, overrides: Mapping[str, Any],
                  device: str | torch.device = "meta", where: str = "model.components") -> torch.nn.Module:
    """``cls`` built from the config in ``folder`` on ``device`` (meta: no memory; elsewhere: freshly initialised
    weights), in ``dtype``; its config read within bounds and the modules it registers counted
    (``bounded_modules``)."""
    from ..runtime.components import bounded_modules

    file = folder / "config.json"
    config = read_json_file(file, where=where)
    if not isinstance(config, dict):
        raise SpecError.single("expected a JSON object", where, str(file))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: no cast afterwards
    try:
        with bounded_modules(f"{cls.__name__}", str(file), where), torch.device(device):
            module = _from_config(cls, folder, {**config, **overrides}, overrides, where)
    finally:
        torch.set_default_dtype(default)
    return module.eval().requires_grad_(False)


def _from_config(cls: type, folder: Path, config: dict[str, Any], overrides: Mapping[str, Any],
                 where: str) -> torch.nn.Module:
    """A diffusers class from its config dict; a transformers class from its ``AutoConfig`` (an Auto class through
    its ``from_config``, a model class called on the config)."""
    if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # diffusers
        return cls.from_config(config)
    from transformers import AutoConfig

    auto = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    for key, value in overrides.items():
        setattr(auto, key, value)
    if hasattr(cls, "from_config"):  # an Auto class
        return cls.from_config(auto, trust_remote_code=False)
    if hasattr(cls, "config_class"):  # a model class: what its from_config would build, without a private helper
        return cls(auto)
    raise SpecError.single(f"{cls.__name__} cannot be built from a config (it has no from_config), so the estimate "
                           "cannot count it", where)


