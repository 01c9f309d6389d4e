"""Policies: checked against the device and family before loading, applied to the loaded modules in one
order (quantization at load, device placement, attention, MLP, cache, offload, compile)."""

from .apply import AppliedPolicies, apply_policies, check_policies, resolve_device
from .caches import CacheRuntime

__all__ = ["AppliedPolicies", "CacheRuntime", "apply_policies", "check_policies", "resolve_device"]
