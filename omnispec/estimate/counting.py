"""Counting a forward on the meta device: FLOPs, attention calls, live activation bytes."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels.torch_internals import TorchDispatchMode, tree_flatten, tree_map
from .report import OpCount

_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution", "aten._convolution")

# ---- counting a forward on meta -----------------------------------------------------------------------------

class Shadow:
    """Real values of the small meta tensors that come from real data (token ids, masks, positions): each op whose
    tensor inputs all have known values is run again on the CPU, so that control flow reading them (``mask.all()``,
    ``mask.sum().item()``, ``.tolist()``) goes as it would in a real run."""

    LIMIT = 1 << 20  # values: larger tensors (latents, activations) are never shadowed

    def __init__(self) -> None:
        self.values: dict[int, torch.Tensor] = {}  # id of a live meta tensor -> its real value (tensors compare by value)

    def known(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return True
        return value.device.type != "meta" or id(value) in self.values

    def real(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return self.values[id(value)]
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    def scalar(self, func: Any, args: tuple) -> Any:
        """The value of ``.item()`` (or ``bool()``) of a shadowed meta tensor; raises as meta would otherwise."""
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.values:
            return func(self.values[id(args[0])], *args[1:])
        return func(*args)

    def through_cpu(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op meta can't shape (its output's shape depends on values: ``nonzero``, boolean indexing): run on the
        CPU with the known values and stride-0 zeros for the unknown ones, and return meta tensors of its shapes."""
        def proxy(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                if id(value) in self.values:
                    return self.values[id(value)]
                return torch.zeros((), dtype=value.dtype).expand(value.shape)
            return self.real(value)

        real = func(*tree_map(proxy, args), **tree_map(proxy, kwargs))
        out = tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype, device="meta") if isinstance(r, torch.Tensor)
                       else r, real)
        if all(self.known(a) for a in tree_flatten((args, kwargs))[0]):
            for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
                if isinstance(o, torch.Tensor):
                    self.values[id(o)] = r
                    weakref.finalize(o, self.values.pop, id(o), None)
        return out

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.device.type == "meta"]
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not outs or any(o.numel() > self.LIMIT for o in outs) or any(a.numel() > self.LIMIT for a in inputs):
            return
        if not all(self.known(a) for a in inputs):
            return
        try:
            real = func(*tree_map(self.real, args), **tree_map(self.real, kwargs))
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(o, torch.Tensor) and o.device.type == "meta" and isinstance(r, torch.Tensor):
                self.values[id(o)] = r
                weakref.finalize(o, self.values.pop, id(o), None)


_SCALARS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")
_NOT_KERNELS = ("aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh", "aten.detach",
                "aten._to_copy_meta")


class _Counter(TorchDispatchMode):
    """Counts FLOPs of matmuls and convolutions (grouped by shapes, kept for timing), tracks the bytes of live meta
    tensors (each storage once, released when its last tensor goes) to find the peak, and shadows small tensors
    that hold real data (``Shadow``)."""

    def __init__(self, shadow: Shadow, device_type: str = "meta") -> None:
        super().__init__()
        self.shadow = shadow
        self.device_type = device_type  # whose tensors count (a test counts a real CPU run the same way)
        self.groups: dict[tuple, OpCount] = {}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors]
        self.current = self.peak = 0
        self.kernels = 0  # ops that make a new tensor on the device (views and allocations excluded)
        self.moved = 0  # bytes read and written by those that are not matmuls or attention

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func._overloadpacket)
        if name in _SCALARS:
            return self.shadow.scalar(func, args) if not kwargs else func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:  # an output shape meta can't know
            try:
                out = self.shadow.through_cpu(func, args, kwargs)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                raise exc from None
        else:
            self.shadow.follow(func, args, kwargs, out)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.device.type == self.device_type]
        if outs and not func.is_view and name not in _NOT_KERNELS:
            self.kernels += 1
            if name not in _MATMULS:
                tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                self.moved += sum(t.numel() * t.element_size() for t in (*tensors, *outs))
        if name in _MATMULS:
            from torch.utils.flop_counter import flop_registry

            counter = flop_registry.get(func._overloadpacket)
            if counter is not None:
                self._record(name, counter(*args, **kwargs, out_val=out), func, args, kwargs)
        for tensor in outs:
            self._hold(tensor)
        return out

    def _record(self, name: str, flops: float, func: Any, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        key = (name, tuple(tuple(t.shape) for t in tensors), tuple(tuple(t.stride()) for t in tensors),
               str(tensors[0].dtype) if tensors else "", repr([a for a in args if not isinstance(a, torch.Tensor)]))
        if key not in self.groups:
            self.groups[key] = OpCount(name, [list(t.shape) for t in tensors], str(tensors[0].dtype), 0, float(flops))
        self.groups[key].calls += 1

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            self.current -= entry[0]
            del self.live[key]


class _Attention(TorchFunctionMode):
    """Attention as fused kernels run it: its FLOPs counted (``4 B H Lq Lk D``), its output made without the score
    matrix (so the peak is that of flash/efficient attention), the call kept for timing."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and args[0].device.type == "meta" and id(args[0]) in self.counter.shadow.values:
            return self.counter.shadow.values[id(args[0])].tolist()
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = dict(zip(("query", "key", "value"), args)) | kwargs
        q, k, v = named["query"], named["key"], named["value"]
        lq, lk = q.shape[-2], k.shape[-2]
        flops = 4 * math.prod(q.shape[:-2]) * lq * lk * q.shape[-1]
        if kwargs.get("is_causal"):
            flops //= 2
        self.counter._record("sdpa", flops, F.scaled_dot_product_attention, args, kwargs)
        self.counter.kernels += 1
        return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)


@contextmanager
def counting(shadow: Shadow, device_type: str = "meta") -> Iterator[_Counter]:
    counter = _Counter(shadow, device_type)
    with torch.no_grad(), counter, _Attention(counter):
        yield counter


