"""Entries of a component's ``config.json`` that its loader acts on beyond building the model: read as data before
any loader sees them.

Two kinds. Entries that make transformers fetch or import code the checkpoint names: an ``attn_implementation``
that is a Hub kernel (``kernels-community/...``), or a flash attention whose package is missing (transformers then
fetches a kernel from the Hub), an ``experts_implementation`` of Hub kernels, a ``quantization_config`` whose
quantizer loads kernels from the Hub (transformers' fp8, mxfp4, eetq, fbgemm_fp8, nvfp4, gguf, metal). These are
refused unless the user trusts the checkpoint's code (``--trust-code``), as ``trust_remote_code`` is.

And the shape of a ``quantization_config``, which the libraries assume: an object with a ``quant_method``; torchao's
``quant_type`` as torchao saves it (``{"default": {"_type": ..., "_data": ...}}``, which torchao resolves by looking
each ``_type`` up in its modules and calling what it finds); bitsandbytes' switches as booleans. A malformed one is
one error naming the file and the entry, not an assertion inside a library. Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .errors import Problem

TRUST = "--trust-code (trust_code=True) allows it for a checkpoint you trust"
# What a checkpoint's config may choose without --trust-code: implementations that are part of transformers and torch.
SAFE_IMPLEMENTATIONS = {
    "attn_implementation": ("eager", "sdpa", "flex_attention"),
    "experts_implementation": ("eager", "grouped_mm", "batched_mm"),
}
_WHAT = {"attn_implementation": "attention", "experts_implementation": "mixture-of-experts code"}
# Quantizers of saved components whose loaders import installed packages only (the others may fetch kernels from the
# Hub: transformers' fp8, mxfp8, mxfp4, eetq, fbgemm_fp8, nvfp4, gguf and metal quantizers, diffusers' nunchaku_lite).
PREQUANTIZED_METHODS = ("torchao", "bitsandbytes", "bitsandbytes_4bit", "bitsandbytes_8bit", "modelopt", "quanto",
                        "auto-round")
_BNB_SWITCHES = ("load_in_4bit", "load_in_8bit", "bnb_4bit_use_double_quant", "llm_int8_has_fp16_weight",
                 "llm_int8_enable_fp32_cpu_offload")
_BNB_NAMES = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")
# torchao's serialised objects name classes (Int8WeightOnlyConfig, PerRow) or torch dtypes (bfloat16).
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
_DTYPE_NAME = re.compile(r"(float|bfloat|int|uint|complex|bool)[a-z0-9_]*")


def code_problems(config: dict[str, Any], where: str, file: str) -> list[Problem]:
    """The entries of ``config`` (a component's ``config.json``, sub-configs included) that would make its loader
    import code the checkpoint chooses, one problem each."""
    problems = [Problem(where, f"{path}: {value!r} makes transformers import the {_WHAT[key]} it names (a kernel "
                               "fetched from the Hub where no installed package provides it); a checkpoint may choose "
                               f"{', '.join(SAFE_IMPLEMENTATIONS[key])}; {TRUST}", file)
                for path, key, value in _implementations(config)]
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if isinstance(method, str) and method not in PREQUANTIZED_METHODS:
        problems.append(Problem(where, f"quantization_config.quant_method: {method!r} is not a quantizer omnispec "
                                       "loads without --trust-code: some fetch and run kernels from the Hub; saved "
                                       f"components load through {', '.join(PREQUANTIZED_METHODS)}; {TRUST}", file))
    return problems


def _implementations(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(path, key, value)`` of every attention or experts implementation in ``node`` that a config may not choose,
    at any depth (a sub-config's ``text_config`` has its own)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _implementations(item, f"{path}{i}.")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in SAFE_IMPLEMENTATIONS:
            chosen = value.items() if isinstance(value, dict) else [("", value)]
            for sub, name in chosen:
                if name is not None and name not in SAFE_IMPLEMENTATIONS[key]:
                    yield f"{path}{key}" + (f".{sub}" if sub else ""), key, name
        else:
            yield from _implementations(value, f"{path}{key}.")


def quantization_problem(value: Any) -> str | None:
    """What is wrong with the shape of a ``quantization_config`` entry, or None."""
    if not isinstance(value, dict):
        return f"quantization_config: expected an object naming its quant_method, got {value!r:.80}"
    method = value.get("quant_method")
    if not isinstance(method, str) or not method:
        return f"quantization_config.quant_method: expected the quantizer's name, got {method!r:.80}"
    skipped = value.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list) and all(isinstance(m, str) for m in skipped)):
        return f"quantization_config.modules_to_not_convert: expected a list of module names, got {skipped!r:.80}"
    if method == "torchao":
        return _torchao_problem(value.get("quant_type"))
    if method.startswith("bitsandbytes"):
        return _bitsandbytes_problem(value)
    return None


def _torchao_problem(quant_type: Any) -> str | None:
    if not isinstance(quant_type, dict) or set(quant_type) != {"default"}:
        return ("quantization_config.quant_type: expected {'default': {'_type': ..., '_data': ...}} as torchao saves "
                f"it, got {quant_type!r:.80}")
    return _torchao_object_problem(quant_type["default"], "quantization_config.quant_type.default")


def _torchao_object_problem(node: Any, path: str) -> str | None:
    """A serialised torchao object: its ``_type`` a class name (or ``torch.dtype`` with a dtype's name), and every
    object nested in its ``_data`` likewise (torchao converts the dicts holding both keys)."""
    if not isinstance(node, dict) or "_type" not in node or "_data" not in node:
        return f"{path}: expected a torchao object {{'_type': ..., '_data': ...}}, got {node!r:.80}"
    kind, data = node["_type"], node["_data"]
    if kind == "torch.dtype":
        if isinstance(data, str) and _DTYPE_NAME.fullmatch(data):
            return None
        return f"{path}._data: {data!r:.60} is not the name of a torch dtype"
    if not isinstance(kind, str) or not _CLASS_NAME.fullmatch(kind):
        return f"{path}._type: {kind!r:.60} is not a torchao class name (torchao calls what the name finds)"
    nested = ((key, child) for key, child in _entries(data)
              if isinstance(child, dict) and "_type" in child and "_data" in child)
    for key, child in nested:
        if problem := _torchao_object_problem(child, f"{path}._data.{key}"):
            return problem
    return None


def _entries(data: Any) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of an object's ``_data``, a list's items as entries of their own (torchao converts the
    objects there too)."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        if isinstance(value, list):
            yield from ((f"{key}.{i}", item) for i, item in enumerate(value))
        else:
            yield str(key), value


def _bitsandbytes_problem(value: dict[str, Any]) -> str | None:
    for key in _BNB_SWITCHES:
        if key in value and not isinstance(value[key], bool):
            return f"quantization_config.{key}: expected true or false, got {value[key]!r:.60}"
    for key in _BNB_NAMES:
        if value.get(key) is not None and not isinstance(value[key], str):
            return f"quantization_config.{key}: expected a name, got {value[key]!r:.60}"
    return None


__all__ = ["PREQUANTIZED_METHODS", "SAFE_IMPLEMENTATIONS", "code_problems", "quantization_problem"]
