"""What a component's ``config.json`` says of weights its checkpoint holds quantized (a ``quantization_config``
written by diffusers' or transformers' ``save_pretrained`` of a quantized model): the method, its scheme and the
compute dtype, for the checkpoint checks and ``explain``. Reads data only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PreQuantized:
    """A component whose checkpoint holds quantized weights (a ``quantization_config`` in its ``config.json``,
    written by diffusers'/transformers' ``save_pretrained`` of a quantized model): it loads as it is, through the
    quantizer that config names."""

    method: str  # quant_method: torchao, bitsandbytes, modelopt, quanto, gguf, auto-round ...
    scheme: str
    compute_dtype: str | None

    def describe(self) -> str:
        compute = f", computes in {self.compute_dtype}" if self.compute_dtype else ""
        return f"{self.method} {self.scheme}{compute}"


def prequantized(config: dict[str, Any]) -> PreQuantized | None:
    """What a component's ``config.json`` says of its quantized weights, or None when it has none."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "unknown"))[:40]
    scheme = _scheme(method, q)
    compute = q.get("bnb_4bit_compute_dtype") or q.get("compute_dtype") or q.get("torch_dtype")
    return PreQuantized(method, scheme[:120], str(compute)[:20] if compute else None)


def _scheme(method: str, q: dict[str, Any]) -> str:
    if method == "torchao":
        kind = q.get("quant_type")
        if isinstance(kind, dict):  # {"default": {"_type": "Int8WeightOnlyConfig", "_data": {"granularity": ...}}}
            inner = kind.get("default", next(iter(kind.values()), {}))
            if isinstance(inner, dict):
                data = inner.get("_data")
                granularity = data.get("granularity") if isinstance(data, dict) else None
                named = granularity.get("_type") if isinstance(granularity, dict) else None
                return f"{inner.get('_type', '?')}" + (f" ({named})" if named else "")
        return str(kind)
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            double = ", double quant" if q.get("bnb_4bit_use_double_quant") else ""
            return f"{q.get('bnb_4bit_quant_type', 'fp4')} 4-bit{double}"
        return "int8 (LLM.int8)"
    for key in ("quant_type", "weights", "bits", "quant_algo", "scheme"):
        if key in q:
            extra = f", group {q['group_size']}" if "group_size" in q else ""
            return f"{key} {q[key]}{extra}"
    return "(scheme not named)"
