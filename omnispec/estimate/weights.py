"""Parameter bytes from safetensors headers, under the declared dtype and quantization, and meta-device modules."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..spec import Component, PipelineSpec, SpecError
from .report import ComponentBytes

# Bytes per stored value of a safetensors dtype.
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                      "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOATING = {"F64", "F32", "F16", "BF16"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bytes per quantized Linear weight value, and per output row of scales (fp32 per-row scales; int4's group scales
# and zero points of 128 values each; nf4's absmax per 64 values, counted per value).
_QUANT_BYTES = {"fp8_dynamic": 1.0, "fp8_weight_only": 1.0, "int8_weight_only": 1.0, "int8_dynamic": 1.0,
                "int8": 1.0, "int4_weight_only": 0.5 + 4 / 128, "nf4": 0.5 + 4 / 64}
_ROW_SCALE_BYTES = {"fp8_dynamic": 4, "fp8_weight_only": 4, "int8_weight_only": 4, "int8_dynamic": 4, "int8": 4}
STAGE_ROLES = {"encode": ("encoder",), "denoise": ("denoiser",), "decode": ("vae", "upsampler")}
GROUPED = ("encoder", "denoiser", "vae", "upsampler")  # roles that model offload moves in and out



# ---- parameter bytes from safetensors headers ---------------------------------------------------------------

def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file holds (name -> dtype, shape), from its header only."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise SpecError.single(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def weight_files(folder: Path, file: str | None = None) -> list[Path]:
    """The safetensors files ``from_pretrained`` would read in a component folder (its index's shards, else the
    plain files; a variant such as ``.fp16.safetensors`` only when nothing else is there)."""
    if file is not None:
        return [folder / file] if (folder / file).suffix == ".safetensors" else []
    for index in sorted(folder.glob("*.safetensors.index.json")):
        if index.name.count(".") == 3:  # diffusion_pytorch_model.safetensors.index.json, not a variant's
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            return [folder / s for s in sorted(set(shards))]
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if f.name.count(".") == 1]
    return plain or files


def component_bytes(spec: PipelineSpec, name: str, component: Component, folder: Path,
                    meta_module: torch.nn.Module | None) -> ComponentBytes:
    dtype_bytes = _DTYPE_BYTES[component.dtype or spec.model.dtype]
    quant = spec.policies.quantization.get(name) or spec.policies.quantization.get(component.role)
    linear = _linear_weights(meta_module, quant.exclude) if quant is not None and meta_module is not None else {}
    files = weight_files(folder, component.file)
    tensors: dict[str, tuple[str, list[int]]] = {}
    how = "safetensors header"
    for path in files:
        for key, info in safetensors_header(path).items():
            tensors[key] = (info["dtype"], info["shape"])
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
        stored += count * _SAFETENSORS_BYTES.get(dtype, 4)
        if key in linear:
            size = int(count * _QUANT_BYTES[quant.method]) + shape[0] * _ROW_SCALE_BYTES.get(quant.method, 0)
        elif dtype in _FLOATING:
            size = count * dtype_bytes
        else:
            size = count * _SAFETENSORS_BYTES.get(dtype, 4)
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
                  device: str | torch.device = "meta") -> torch.nn.Module:
    """``cls`` built from the config in ``folder`` on ``device`` (meta: no memory; elsewhere: freshly initialised
    weights), in ``dtype``."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: no cast afterwards
    try:
        if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # diffusers
            config = {**cls.load_config(folder), **overrides}
            with torch.device(device):
                module = cls.from_config(config)
        else:  # transformers
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(folder)
            for key, value in overrides.items():
                setattr(config, key, value)
            with torch.device(device):
                module = cls._from_config(config)
    finally:
        torch.set_default_dtype(default)
    return module.eval().requires_grad_(False)


