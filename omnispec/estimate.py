"""``omnispec explain --estimate``: what a run will cost, before any weight loads.

- **Parameter bytes** per component from its safetensors headers (the first few KB of each file: names, dtypes,
  shapes), counted in the dtype the component loads in and under the declared quantization (torchao/bitsandbytes
  store a quantized ``Linear`` weight in 1 byte per value for fp8/int8, half a byte for int4/nf4, plus scales). A
  component without safetensors is counted from its config, built on the meta device.
- **FLOPs per denoiser forward**, counted on the meta device: every weighted component is built from its config
  on ``meta`` (no memory), the family encodes a prompt and runs its denoiser exactly as a request would, and each
  matmul, convolution and attention call is counted (torch's ``flop_registry``; attention as ``4 B H Lq Lk D``).
- **Peak device memory** under the declared offload policy: the weights on the device in each stage (encode,
  denoise, decode) plus that stage's activations, which the meta run measures as the largest total size of live
  tensors (attention as the fused kernels run it: no score matrix).
- **Time per step**: the counted matmul and attention calls, grouped by shape, each timed on the target device
  with random data; the other ops' bytes read and written at the device's measured copy rate; the larger of that and
  the ops' count times the measured cost of launching one; and under layerwise/group offload on CUDA, the
  host-to-device copy of the denoiser's blocks at the measured rate (overlapped with compute when prefetching).

Encoding and decoding time are not estimated; ``render_estimate`` says what each number covers.
"""

from __future__ import annotations

import json
import math
import struct
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .log import logger
from .spec import Component, PipelineSpec, SpecError
from .spec.model import WEIGHTLESS_ROLES

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
_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution", "aten._convolution")
STAGE_ROLES = {"encode": ("encoder",), "denoise": ("denoiser",), "decode": ("vae", "upsampler")}
GROUPED = ("encoder", "denoiser", "vae", "upsampler")  # roles that model offload moves in and out


@dataclass
class ComponentBytes:
    name: str
    role: str
    params: int
    stored_bytes: int
    bytes: int  # on the device, in its load dtype and quantization
    how: str  # "safetensors header" or "config (meta)"
    blocks: dict[str, int] = field(default_factory=dict)  # repeated block -> bytes (offload streams these)


@dataclass
class OpTiming:
    op: str
    shapes: list[list[int]]
    dtype: str
    calls: int
    flops: float  # per call
    seconds: float | None = None  # per call, measured on the device
    replay: Any = field(default=None, repr=False, compare=False)  # (func, meta args, kwargs) to time it again

    @property
    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.seconds else None


@dataclass
class Estimate:
    device: str
    request: dict[str, Any]
    components: list[ComponentBytes]
    denoiser: str | None = None
    passes: int = 1
    rows_per_forward: int = 1
    forwards_per_step: int = 1
    forward_flops: float | None = None
    step_flops: float | None = None
    activation_bytes: dict[str, int] = field(default_factory=dict)  # stage -> peak live bytes
    peak_bytes: int | None = None
    peak_stage: str | None = None
    weights_on_device: dict[str, int] = field(default_factory=dict)  # stage -> bytes
    ops: list[OpTiming] = field(default_factory=list)
    coverage: float | None = None  # share of forward FLOPs in the timed ops
    compute_seconds: float | None = None  # per forward: matmuls and attention, as timed
    kernels: int | None = None  # device ops per forward
    moved_bytes: int | None = None  # bytes read and written per forward by the other ops
    memory_seconds: float | None = None  # per forward: moved_bytes at the measured copy rate
    overhead_seconds: float | None = None  # per forward: kernels x the measured cost of launching one
    transfer_seconds: float | None = None  # per forward (offload)
    step_seconds: float | None = None
    steps: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        ops, self.ops = self.ops, []
        try:
            out = asdict(self)
        finally:
            self.ops = ops
        out["ops"] = [{"op": op.op, "shapes": op.shapes, "dtype": op.dtype, "calls": op.calls, "flops": op.flops,
                       "seconds": op.seconds, "tflops": op.tflops} for op in ops]
        return out


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
        self.groups: dict[tuple, OpTiming] = {}
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
            self.groups[key] = OpTiming(name, [list(t.shape) for t in tensors], str(tensors[0].dtype), 0, float(flops),
                                        replay=(func, args, kwargs))
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


# ---- timing on the device -----------------------------------------------------------------------------------

def _real(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor) or value.device.type != "meta":
        return value
    if value.is_floating_point():
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return out.normal_() if out.numel() else out
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(func: Any, args: tuple, kwargs: dict, device: torch.device, budget: float = 0.1) -> float:
    """Seconds per call of ``func`` on ``device`` with random inputs shaped as ``args``."""
    args, kwargs = tree_map(lambda v: _real(v, device), (args, kwargs))
    with torch.no_grad():
        for _ in range(2):
            func(*args, **kwargs)
        _sync(device)
        calls, start = 0, time.perf_counter()
        while calls < 3 or (time.perf_counter() - start < budget and calls < 200):
            func(*args, **kwargs)
            calls += 1
            if calls % 10 == 0:
                _sync(device)
        _sync(device)
    return (time.perf_counter() - start) / calls


def copy_rate(device: torch.device) -> float:
    """Bytes per second read plus written by a device-to-device copy (what memory-bound ops move)."""
    nbytes = (256 << 20) if device.type == "cuda" else (64 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    seconds = time_call(torch.Tensor.copy_, (target, source), {}, device)
    return 2 * nbytes / seconds


def launch_seconds(device: torch.device, ops: int = 200) -> float:
    """The cost of one small op from Python (eager dispatch and kernel launch)."""
    x = torch.zeros(16, device=device)
    for _ in range(20):
        x.add_(1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - start) / ops


def host_to_device_rate(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes per second of a pinned host-to-device copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    _sync(device)
    start = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    _sync(device)
    return 3 * nbytes / (time.perf_counter() - start)


# ---- the estimate -------------------------------------------------------------------------------------------

def estimate(spec: PipelineSpec, source: str | None = None, device: str | None = None,
             time_ops: bool = True, **request: Any) -> Estimate:
    """Estimate a request of ``spec`` (its recipe's defaults, or ``request`` fields) on ``device`` from the
    checkpoint at ``source`` (else ``model.source``; a local folder or the Hub cache), loading no weights."""
    from .policies import resolve_device
    from .runtime.build import check_device

    check_device(device or spec.runtime.device, "--device" if device else "runtime.device")
    target = resolve_device(device or spec.runtime.device)
    root = _checkpoint_root(spec, source)
    from .spec.checkpoint import checkpoint_problems, follow_checkpoint, read_configs

    configs = read_configs(spec, str(root))
    problems = checkpoint_problems(spec, configs)
    if problems:
        raise SpecError(problems)
    spec = follow_checkpoint(spec, configs)
    modules, counts = _modules(spec, root)
    result = Estimate(str(target), {}, counts)
    _count_run(spec, modules, result, request)
    _peak(spec, result)
    if time_ops:
        _time(result, target, spec)
    return result


def _checkpoint_root(spec: PipelineSpec, source: str | None) -> Path:
    root = source or spec.model.source
    if not root:
        raise SpecError.single("no checkpoint: the spec has no model.source and no --source was given", "--source")
    local = Path(root).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the Hub cache's snapshot: config files and safetensors headers are read from there
        return Path(snapshot_download(root, revision=spec.model.revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise SpecError.single(f"{root!r} is neither a local checkpoint folder nor in the Hub cache; the estimate "
                               "reads config files and safetensors headers from disk: pass --source DIR", "--source"
                               ) from None


def _modules(spec: PipelineSpec, root: Path) -> tuple[dict[str, Any], list[ComponentBytes]]:
    """Weighted components on meta (with their byte counts); tokenizers, processors and schedulers loaded (small)."""
    from .runtime.components import DTYPES, component_class, load_components

    light = {n: c for n, c in spec.model.components.items() if c.role in WEIGHTLESS_ROLES}
    quiet = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"progress": False})})
    modules: dict[str, Any] = load_components(quiet, str(root), only=light) if light else {}
    counts = []
    for name, component in spec.model.components.items():
        if name in light:
            continue
        folder = Path(component.source or root) / (component.subfolder or "")
        cls = component_class(component)
        module = None
        if component.file is None:
            try:
                module = config_module(cls, folder, DTYPES[component.dtype or spec.model.dtype], component.config)
            except (OSError, ValueError, TypeError) as exc:
                logger.warning(f"estimate: {name} not built on meta ({exc}); its FLOPs are not counted")
        modules[name] = module
        counts.append(component_bytes(spec, name, component, folder, module))
    return modules, counts


def _count_run(spec: PipelineSpec, modules: dict[str, Any], result: Estimate, fields: dict[str, Any]) -> None:
    """One request's first denoiser forward (and its decode) on meta: FLOPs, op shapes, peak live bytes."""
    from .runtime.families import Conditioning, family_class
    from .runtime.run import phase_passes
    from .spec.plan import compile_plan
    from .spec.request import resolve_request

    phase = spec.recipe.phases[0]
    result.denoiser = phase.denoiser
    if any(m is None for m in modules.values()):
        result.notes.append("FLOPs not counted: a component could not be built on the meta device")
        return
    meta = torch.device("meta")
    images = {}
    if spec.recipe.task.startswith("image") and "image" not in fields and "conditions" not in fields:
        from PIL import Image

        side = spec.recipe.defaults.height or 512
        images = {"image": Image.new("RGB", (spec.recipe.defaults.width or side, side), (128, 128, 128))}
    request = resolve_request(spec, "a photo of a cat", 0, **images, **fields)
    result.request = {k: v for k, v in request.model_dump(exclude={"images", "prompts", "seeds"}).items()
                      if v not in (None, "")}
    result.steps = request.steps
    shadow = Shadow()
    try:
        family = family_class(spec.model.family)(spec, modules, meta)
        generators = [torch.Generator("cpu").manual_seed(0)]
        with counting(shadow) as counter:
            geometry = family.geometry(request, phase.size_scale)
            latents = family.initial_latents(geometry, generators)
            positive = family.encode(list(request.prompts), request)
            image_cond = family.encode_images(request, geometry, generators)
        result.activation_bytes["encode"] = counter.peak
        plans = compile_plan(phase.guidance, 1, [1.0])
        passes = phase_passes(phase, positive.with_(image_cond), positive.with_(image_cond))
        names = list(plans[0].passes)
        result.passes = len(names)
        tokens = family.tokens(geometry)
        max_rows = _max_rows(spec, tokens)
        rows = len(names) if max_rows is None else max(1, min(max_rows, len(names)))
        result.rows_per_forward = rows
        result.forwards_per_step = math.ceil(len(names) / rows)
        with counting(shadow) as counter:
            cond = Conditioning.cat([passes.conditions[n] for n in names[:rows]])
            x = {s: torch.cat([v] * rows) for s, v in latents.items()}
            t = torch.full((), 500.0, device=meta)
            family.predict(modules[phase.denoiser], x, t, cond, geometry, embedded=plans[0].embedded)
        result.forward_flops = sum(g.flops * g.calls for g in counter.groups.values())
        result.step_flops = result.forward_flops * len(names) / rows
        result.activation_bytes["denoise"] = counter.peak
        result.ops = sorted(counter.groups.values(), key=lambda g: -g.flops * g.calls)
        result.kernels, result.moved_bytes = counter.kernels, counter.moved
        result.notes.append(f"request: 1 sample, {len(names)} pass(es) per step in {result.forwards_per_step} "
                            f"forward(s) of {rows} row(s), {tokens} image tokens per row")
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError, IndexError) as exc:
        logger.debug("estimate: the meta forward failed", exc_info=True)
        result.notes.append(f"FLOPs not counted: the denoiser forward did not run on the meta device ({exc})")
        return
    with counting(shadow) as counter:  # the VAE runs; converting its pixels on the host then fails on meta
        try:
            family.decode(latents, geometry)
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
            pass
    result.activation_bytes["decode"] = counter.peak


def _max_rows(spec: PipelineSpec, tokens: int) -> int | None:
    """Rows per forward, as ``Run`` bounds them (``runtime.max_batch``, ``max_tokens_per_forward``)."""
    runtime = spec.runtime
    limits = [runtime.max_batch] if runtime.max_batch else []
    if runtime.max_tokens_per_forward:
        limits.append(max(1, runtime.max_tokens_per_forward // max(1, tokens)))
    return min(limits) if limits else None


def _peak(spec: PipelineSpec, result: Estimate) -> None:
    """Weights on the device in each stage under the offload policy, plus that stage's activations."""
    offload = spec.policies.offload
    total = sum(c.bytes for c in result.components)
    stages = {}
    for stage, roles in STAGE_ROLES.items():
        if offload.strategy == "none":
            weights = total
        elif offload.strategy == "model":  # one role-group at a time; resident and other roles stay
            weights = sum(c.bytes for c in result.components if c.role in roles or c.role not in GROUPED)
        else:  # layerwise / group: each denoiser's blocks stream in (on CUDA the next group prefetched meanwhile)
            weights = total
            prefetch = offload.prefetch and result.device.startswith("cuda")
            groups = getattr(offload, "blocks_per_group", 1) * (2 if prefetch else 1)
            for c in result.components:
                if c.role == "denoiser" and c.blocks:
                    streamed = sum(c.blocks.values())
                    weights -= streamed
                    if stage == "denoise":
                        weights += min(streamed, groups * max(c.blocks.values()))
        stages[stage] = weights
    result.weights_on_device = stages
    peaks = {stage: stages[stage] + result.activation_bytes.get(stage, 0) for stage in stages}
    result.peak_stage = max(peaks, key=lambda s: peaks[s])
    result.peak_bytes = peaks[result.peak_stage]


def _time(result: Estimate, device: torch.device, spec: PipelineSpec, coverage: float = 0.97,
          most: int = 16) -> None:
    """Time the ops that make up ``coverage`` of the forward's FLOPs on ``device``; the rest is scaled in."""
    if not result.forward_flops:
        return
    covered = seconds = 0.0
    for group in result.ops[:most]:
        func, args, kwargs = group.replay
        group.seconds = time_call(func, args, kwargs, device)
        covered += group.flops * group.calls
        seconds += group.seconds * group.calls
        if covered >= coverage * result.forward_flops:
            break
    result.coverage = covered / result.forward_flops
    result.compute_seconds = seconds / result.coverage
    result.memory_seconds = (result.moved_bytes or 0) / copy_rate(device)
    result.overhead_seconds = (result.kernels or 0) * launch_seconds(device)
    # Kernels run back to back while the host queues the next ones: the slower of the two sets the pace.
    per_forward = max(result.compute_seconds + result.memory_seconds, result.overhead_seconds)
    offload = spec.policies.offload
    if offload.strategy in ("layerwise", "group") and device.type == "cuda":
        streamed = sum(sum(c.blocks.values()) for c in result.components if c.role == "denoiser")
        result.transfer_seconds = streamed / host_to_device_rate(device)
        per_forward = (max(per_forward, result.transfer_seconds) if offload.prefetch
                       else per_forward + result.transfer_seconds)
    result.step_seconds = per_forward * result.forwards_per_step


# ---- rendering ----------------------------------------------------------------------------------------------

def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def render_estimate(e: Estimate) -> str:
    request = ", ".join(f"{k} {v}" for k, v in e.request.items())
    lines = [f"estimate for {e.device} ({request}):"]
    lines.append(f"  {'component':<16} {'role':<10} {'params':>8} {'stored':>10} {'on device':>10}  from")
    for c in e.components:
        lines.append(f"  {c.name:<16} {c.role:<10} {_count(c.params):>8} {_size(c.stored_bytes):>10} "
                     f"{_size(c.bytes):>10}  {c.how}")
    if e.forward_flops is not None:
        lines.append(f"  denoiser forward ({e.denoiser}, {e.rows_per_forward} row(s)): {_flops(e.forward_flops)}; "
                     f"per step {_flops(e.step_flops or 0)}")
    if e.peak_bytes is not None:
        weights = e.weights_on_device.get(e.peak_stage or "", 0)
        act = e.activation_bytes.get(e.peak_stage or "", 0)
        lines.append(f"  peak device memory: {_size(e.peak_bytes)} while {e.peak_stage} (weights {_size(weights)} + "
                     f"activations {_size(act)})")
    if e.step_seconds is not None:
        rate = (e.forward_flops or 0) / e.compute_seconds / 1e12 if e.compute_seconds else 0
        line = (f"  time per step: {e.step_seconds * 1e3:.4g} ms ({e.forwards_per_step} forward(s); matmuls and "
                f"attention timed on this device: {e.compute_seconds * 1e3:.4g} ms, {100 * (e.coverage or 0):.0f}% of "
                f"the FLOPs at {rate:.3g} TFLOP/s; other ops {_size(e.moved_bytes or 0)} moved: "
                f"{(e.memory_seconds or 0) * 1e3:.3g} ms; {e.kernels} ops launched: {(e.overhead_seconds or 0) * 1e3:.3g} ms")
        if e.transfer_seconds is not None:
            line += f"; block copies {e.transfer_seconds * 1e3:.4g} ms per forward"
        lines.append(line + ")")
        if e.steps:
            lines.append(f"  denoising {e.steps} steps: {e.step_seconds * e.steps:.3g} s (encoding and decoding not "
                         "included)")
    lines += [f"  note: {note}" for note in e.notes]
    return "\n".join(lines)


__all__ = ["ComponentBytes", "Estimate", "OpTiming", "estimate", "render_estimate", "safetensors_header"]
