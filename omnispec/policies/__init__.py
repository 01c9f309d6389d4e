"""Policies: checked against the device and family before loading, applied to the loaded modules in one
order (quantization at load, dtype/device, attention, cache, offload, compile)."""

from .apply import apply_policies, check_policies, resolve_device

__all__ = ["apply_policies", "check_policies", "resolve_device"]
