"""Model offload: one role-group at a time on the device (encoders, then denoisers, then VAE/upsampler);
``resident`` and ``other`` roles stay put. Written here as a diffusers ``ModelHook`` on each component
and its direct children (so ``vae.decode``, which never calls ``vae.forward``, still triggers it), because
diffusers' own model offload is a pipeline method and omnispec applies policies to modules.
On an accelerator each plain weight and buffer keeps one host copy for the pipeline's life, page-locked the
first time it goes to the device: moving a group out copies into that copy (no new host memory, no page
faults, DMA speed) and moving it in copies from it without blocking the host. ``Module.to`` (what diffusers'
``enable_model_cpu_offload`` does through accelerate) instead allocates fresh pageable host memory for every
tensor on every move out and stages every move in through the driver's pageable path. Tensor subclasses
(torchao, bitsandbytes weights) still move with ``Module.to``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ...bridge import remove_hook

GROUPS = {"encoder": "encoders", "denoiser": "denoisers", "vae": "decoders", "upsampler": "decoders"}
HOOK_NAME = "omnispec_model_offload"


def _to(obj: Any, device: torch.device) -> Any:
    """A call's arguments on ``device``. Lists and dicts are moved in place and passed on as themselves: a callee
    may write into them (Wan's VAE decodes chunk by chunk through the ``feat_cache`` list it is given, and a copy
    would lose every chunk's cache, decoding one frame per latent frame)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        obj[:] = [_to(o, device) for o in obj]
        return obj
    if isinstance(obj, tuple):
        return type(obj)(*(_to(o, device) for o in obj)) if hasattr(obj, "_fields") else \
            tuple(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _to(value, device)
        return obj
    return obj


def _slots(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """(owner, "param" | "buffer", name, tensor) of every plain tensor of ``module``, each tensor once (tied
    weights are one Parameter object)."""
    seen: set[int] = set()
    for owner in module.modules():
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
            for name, t in table.items():
                if t is None or id(t) in seen or type(t) not in (torch.Tensor, torch.nn.Parameter) \
                        or type(t.data) is not torch.Tensor:
                    continue
                seen.add(id(t))
                yield owner, kind, name, t


def _put(owner: torch.nn.Module, kind: str, name: str, t: torch.Tensor, new: torch.Tensor) -> None:
    if kind == "param":
        t.data = new  # as Module.to does: the Parameter object (and any tie to it) stays
    else:
        owner._buffers[name] = new


# Host copies are page-locked in chunks of about this many bytes: each chunk one buffer registered with the driver
# (exact size; the caching host allocator behind ``pin_memory`` rounds every tensor up to a power of two: what that
# cost FLUX's transformer is in BENCHMARKS.md, "Offload"), small enough that the first onload of a component holds it
# twice only a chunk at a time.
PIN_CHUNK_BYTES = 256 << 20
_ALIGN = 512  # bytes between tensors in a chunk (any dtype's alignment, and the copy engines' preferred one)


class _Placement:
    """Which group is on the device now; moving one group in moves the others out. With ``copies`` (the
    default off the CPU) tensors move through one persistent host copy each (``host``), page-locked on CUDA in
    registered chunks. A tensor unchanged since it came in (same storage, same in-place version counter) is not
    copied back on the way out: its host copy already holds its bytes, so only changed tensors (a weight sync, a
    LoRA fused on the device) cross the bus twice."""

    def __init__(self, groups: dict[str, list[torch.nn.Module]], device: torch.device, copies: bool | None = None):
        self.groups, self.device, self.current = groups, device, None
        self.copies = device.type != "cpu" if copies is None else copies
        self.pin = device.type == "cuda"
        self.host: dict[tuple[int, str, str], torch.Tensor] = {}
        self.onloaded: dict[tuple[int, str, str], tuple[int, int]] = {}  # key -> (device data_ptr, version)
        self.copied_back = 0  # bytes copied device -> host (tests and benchmarks read it)
        self.buffers: list[torch.Tensor] = []  # the registered chunks, kept (and registered) for the placement's life

    def bring(self, group: str) -> None:
        if self.current == group:
            return
        for name, modules in self.groups.items():
            if name != group:
                for m in modules:
                    self._out(m)
        for m in self.groups[group]:
            self._in(m)
        self.current = group

    def _on_host(self, key: tuple[int, str, str], t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        if self.device.type != "cpu":
            return True
        host = self.host.get(key)  # the device is the CPU (tests): tell the two copies apart by storage
        return host is None or t.data_ptr() == host.data_ptr()

    def _out(self, module: torch.nn.Module) -> None:
        if self.copies:
            for owner, kind, name, t in _slots(module):
                key = (id(owner), kind, name)
                if self._on_host(key, t):
                    continue
                host = self.host.get(key)
                same = host is not None and host.shape == t.shape and host.dtype == t.dtype and \
                    host.stride() == t.stride()
                if same and self.onloaded.get(key) == (t.data_ptr(), t._version):
                    pass  # unchanged on the device: the host copy is current
                elif same:
                    host.copy_(t.detach())  # into the kept copy, so changes made on the device come back
                    self.copied_back += t.numel() * t.element_size()
                else:  # first seen on the device, or replaced there by a tensor of another shape or dtype
                    host = self.host[key] = t.detach().to("cpu")
                    self.copied_back += t.numel() * t.element_size()
                _put(owner, kind, name, t, host)
        module.to("cpu")  # tensor subclasses; plain tensors already on the host stay as they are

    def _in(self, module: torch.nn.Module) -> None:
        if self.copies:
            slots = [(owner, kind, name, t) for owner, kind, name, t in _slots(module)
                     if self._on_host((id(owner), kind, name), t)]
            if self.pin:  # tensors without a host copy of ours yet (the loaded weights, a tensor replaced)
                self._pin([(o, k, n, t) for o, k, n, t in slots
                           if (o_host := self.host.get((id(o), k, n))) is None or o_host.data_ptr() != t.data_ptr()])
            for owner, kind, name, t in slots:
                key = (id(owner), kind, name)
                host = self.host.get(key)
                if host is None or host.data_ptr() != t.data_ptr():
                    host = self.host[key] = t.detach()
                _put(owner, kind, name, t, host.to(self.device, non_blocking=host.is_pinned(), copy=True))
                self.onloaded[key] = (t.data_ptr(), t._version)
        module.to(self.device)

    def _pin(self, slots: list[tuple[torch.nn.Module, str, str, torch.Tensor]]) -> None:
        """Page-locked host copies of these tensors, in registered chunks of about ``PIN_CHUNK_BYTES``; each
        tensor's slot then points at its copy. Where the driver refuses (not enough lockable memory), the
        pageable tensors stay as they are."""
        chunk: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
        size = 0
        for slot in slots:
            chunk.append(slot)
            size += -(-slot[3].numel() * slot[3].element_size() // _ALIGN) * _ALIGN
            if size >= PIN_CHUNK_BYTES:
                self._pin_chunk(chunk, size)
                chunk, size = [], 0
        if chunk:
            self._pin_chunk(chunk, size)

    def _pin_chunk(self, chunk: list[tuple[torch.nn.Module, str, str, torch.Tensor]], size: int) -> None:
        buffer = registered_host_buffer(size)
        if buffer is None:
            return
        self.buffers.append(buffer)
        offset = 0
        for owner, kind, name, t in chunk:
            n = t.numel() * t.element_size()
            view = buffer[offset:offset + n].view(t.dtype).view(t.shape) if t.is_contiguous() else None
            if view is None:  # a strided host tensor keeps its layout, in pinned memory of its own
                view = t.detach().pin_memory()
            else:
                view.copy_(t.detach())
            self.host[(id(owner), kind, name)] = view
            _put(owner, kind, name, t, view)
            offset += -(-n // _ALIGN) * _ALIGN


def registered_host_buffer(size: int) -> torch.Tensor | None:
    """``size`` bytes of host memory page-locked by ``cudaHostRegister`` (exactly that much, unlike the caching
    host allocator), unregistered when this tensor object is collected (its views may live on as plain host
    memory); None when the driver refuses."""
    import weakref

    buffer = torch.empty(max(size, 1), dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) != 0:
        return None
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


class _BringGroupHook(ModelHook):
    def __init__(self, placement: _Placement, group: str):
        super().__init__()
        self.placement, self.group = placement, group

    def pre_forward(self, module, *args, **kwargs):
        self.placement.bring(self.group)
        return _to(args, self.placement.device), _to(kwargs, self.placement.device)


class ModelOffload:
    """One role-group on the device at a time, moved by a hook on each component and its direct children."""

    def apply(self, policy: Any, modules: dict[str, torch.nn.Module], roles: dict[str, str],
              device: torch.device) -> str:
        groups: dict[str, list[torch.nn.Module]] = {}
        for name, m in modules.items():
            group = GROUPS.get(roles[name])
            if group is None:  # resident / other: stay on the device
                m.to(device)
                continue
            m.to("cpu")
            groups.setdefault(group, []).append(m)
        placement = _Placement(groups, device, copies=None if policy.pin_memory else False)
        for group, members in groups.items():
            for m in members:
                for target in (m, *m.children()):
                    registry = HookRegistry.check_if_exists_or_initialize(target)
                    registry.register_hook(_BringGroupHook(placement, group), HOOK_NAME)
        host = sum(t.numel() * t.element_size() for ms in groups.values() for m in ms for *_, t in _slots(m))
        return ("model: " + ", ".join(f"{g} [{len(ms)}]" for g, ms in groups.items()) + f" take turns on {device}; "
                f"host memory {host / 2**30:.2f} GiB for their weights" + (" (page-locked)" if placement.pin else ""))

    def device_bytes(self, policy: Any, stage: str, roles: tuple[str, ...], components: list[Any],
                     accelerator: bool) -> int:
        """The stage's own roles plus every role model offload never moves (resident, other)."""
        return sum(c.bytes for c in components if c.role in roles or c.role not in GROUPS)

    def host_bytes(self, policy: Any, components: list[Any]) -> int:
        """Every moved component's weights, in one host copy each (page-locked with ``pin_memory``)."""
        return sum(c.bytes for c in components if c.role in GROUPS)


def remove_model_offload(modules: dict[str, torch.nn.Module]) -> None:
    """An earlier build's model offload over these modules ends here."""
    for m in modules.values():
        for target in (m, *m.children()):
            remove_hook(target, HOOK_NAME)


MODEL = ModelOffload()
