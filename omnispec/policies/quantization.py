"""Quantization at load, through diffusers'/transformers' quantization configs (torchao, bitsandbytes).

A spec keys methods by component name or role; ``load_kwargs`` gives ``from_pretrained`` its
``quantization_config``. ``check`` rejects, before anything loads, a method the target can't run.
Components handed to ``build`` already in memory (a trainer's, a benchmark's) never pass through
``from_pretrained``; ``quantize_in_memory`` gives them the same torchao config through torchao's own
``quantize_``, which is what diffusers' torchao quantizer applies after loading.

torchao's quantized linears compute forwards only: ``_scaled_mm`` (fp8) has no derivative, and int8 dynamic
quantization cuts the graph at the activation, so a LoRA replayed with gradients through such a base would get
an error, or silently no gradient from every layer above its own. ``keep_input_gradients`` gives those linears
the backward bitsandbytes' QLoRA layers have: dL/dx through the dequantized weight, the forward untouched.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ..spec import Component, PipelineSpec, SpecError
from ..spec.errors import Problem
from ..spec.policies import CUDA_ONLY_METHODS, TORCHAO_METHODS, Quantization

_TORCHAO_CONFIGS = {
    "fp8_dynamic": "Float8DynamicActivationFloat8WeightConfig",
    "fp8_weight_only": "Float8WeightOnlyConfig",
    "int8_weight_only": "Int8WeightOnlyConfig",
    "int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
    "int4_weight_only": "Int4WeightOnlyConfig",
}
# The least absolute maximum an fp8 activation scale is taken from: torchao.float8's EPS for the same clamp
FP8_ACTIVATION_FLOOR = 1e-12


def method_for(spec: PipelineSpec, name: str, component: Component) -> Quantization | None:
    key = spec.policies.quantization_key(name, component.role)
    return spec.policies.quantization[key] if key is not None else None


def check(spec: PipelineSpec, device: torch.device) -> list[Problem]:
    problems = []
    for key, q in spec.policies.quantization.items():
        where = f"policies.quantization.{key}.method"
        lib = "torchao" if q.method in TORCHAO_METHODS else "bitsandbytes"
        if importlib.util.find_spec(lib) is None:
            problems.append(Problem(where, f"{q.method} needs {lib}: pip install 'omnispec-diffusion[quant]'"))
            continue
        if q.method == "fp8_dynamic" and q.granularity == "row" and spec.model.dtype != "bfloat16":
            problems.append(Problem(f"policies.quantization.{key}.granularity", "torchao's per-row fp8 scales take "
                                    f"bfloat16 weights only; model.dtype is {spec.model.dtype}"))
        if q.method in CUDA_ONLY_METHODS and device.type != "cuda":
            problems.append(Problem(where, f"{q.method} runs only on CUDA; the target is {device}"))
        elif q.method.startswith("fp8") and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                problems.append(Problem(where, f"{q.method} needs compute capability >= 8.9, this GPU has {major}.{minor}"))
    return problems


def torchao_config(method: str, granularity: str | None = None) -> Any:
    """torchao's config for ``method``, leaving the process's compiler settings alone: by default each torchao
    config, once applied, turns on inductor's coordinate-descent tuning in every direction for the whole process
    (and torchao 0.17 also sets float32 matmuls to TF32). That tuning benchmarks Triton configs at every new
    kernel's first launch, which made a quantized rollout's first compile last minutes (BENCHMARKS.md, "fp8 and
    int8 quantization"), and every compiled pipeline of the process, bf16 or not, inherited both. Compile settings
    are the compile policy's (``autotune`` turns that tuning on where asked).

    fp8 activations get a floor on the absolute maximum their scales are taken from (torchao's float8 training
    clamps it the same way): without one, a row of zeros (the zero padding Wan, among others, gives its prompt
    embeddings) gets the scale 0 and quantizes to 0/0, and one NaN row spreads through the next attention to the
    whole output."""
    import torchao.quantization as tq

    kwargs: dict[str, Any] = {"set_inductor_config": False}
    if granularity:
        kwargs["granularity"] = {"tensor": tq.PerTensor, "row": tq.PerRow}[granularity]()
    if method == "fp8_dynamic":
        kwargs["activation_value_lb"] = FP8_ACTIVATION_FLOOR
    return getattr(tq, _TORCHAO_CONFIGS[method])(**kwargs)


def quantize_in_memory(spec: PipelineSpec, name: str, component: Component, module: Any,
                       device: torch.device | None = None) -> str | None:
    """Quantize an in-memory component as its policy says; returns a note for ``explain``, or None.
    A CUDA-only method quantizes on ``device`` (torchao computes fp8/int4 weights with CUDA kernels)."""
    q = method_for(spec, name, component)
    if q is None or not isinstance(module, torch.nn.Module) or getattr(module, "is_quantized", False):
        return None  # no policy, or already quantized when it was loaded
    if q.method not in TORCHAO_METHODS:
        raise SpecError.single(
            f"{q.method} (bitsandbytes) swaps layers while a checkpoint loads; component {name!r} was passed in "
            "memory, so load it from the checkpoint or use a torchao method", f"policies.quantization.{name}")
    from torchao.quantization import quantize_
    from torchao.utils import TorchAOBaseTensor

    # Linears an earlier build over the same modules quantized: torchao cannot quantize its own tensors again (its
    # default filter no longer skips them), so they stay as they are, and the note says so
    done = sum(isinstance(child, torch.nn.Linear) and isinstance(child.weight, TorchAOBaseTensor)
               for child in module.modules())

    def wanted(child: torch.nn.Module, fqn: str) -> bool:
        # exclude entries match as diffusers matches modules_to_not_convert ("<entry>." inside the name)
        return (isinstance(child, torch.nn.Linear) and not isinstance(child.weight, TorchAOBaseTensor)
                and not any(f"{entry}." in f"{fqn}." for entry in q.exclude))

    if q.method in CUDA_ONLY_METHODS and device is not None and next(module.parameters()).device != device:
        module.to(device)
    quantize_(module, torchao_config(q.method, q.granularity), filter_fn=wanted)
    kept = f"; {done} linears already quantized by torchao (an earlier build over these modules) kept as they were"
    return f"{name}: {q.method} (torchao quantize_, in memory){kept if done else ''}"


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A torchao weight's values in its high-precision dtype. torchao before 0.18 wraps int8 dynamic weights in an
    activation-quantizing tensor that cannot dequantize itself; its inner weight can."""
    return getattr(weight, "original_weight_tensor", weight).dequantize()


class _InputGradientThroughDequantized(torch.autograd.Function):
    """``linear(x, weight, bias)`` as the quantized weight computes it, with dL/dx = dL/dy @ dequantize(weight)
    (the straight-through rule for the activation's quantization) and dL/dbias when the bias trains; the quantized
    weight itself is frozen."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.bias_trains = bias is not None and bias.requires_grad
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_x = grad @ dequantized(weight).to(grad.dtype)
        return grad_x, None, grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_trains else None


class QuantizedLinear(torch.nn.Linear):
    """A ``Linear`` holding a torchao quantized weight whose input gets gradients (see the module docstring).
    Without gradients it is ``Linear.forward`` itself, so rollouts and no-grad replays run the same kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trains = x.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if torch.is_grad_enabled() and trains:
            return _InputGradientThroughDequantized.apply(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def keep_input_gradients(modules: dict[str, Any]) -> int:
    """Make every plain ``Linear`` with a torchao weight a ``QuantizedLinear`` (quantized at load, in memory, or
    in a pre-quantized checkpoint); returns how many. Its class changes, nothing else: peft wraps it as any
    ``Linear``, and its state dict is the same."""
    changed = 0
    for module in modules.values():
        if not isinstance(module, torch.nn.Module):
            continue
        for child in module.modules():
            if type(child) is torch.nn.Linear and type(child.weight).__module__.startswith("torchao."):
                child.__class__ = QuantizedLinear
                changed += 1
    return changed


def load_kwargs(spec: PipelineSpec, name: str, component: Component, cls: type) -> dict[str, Any]:
    q = method_for(spec, name, component)
    if q is None:
        return {}
    from_transformers = cls.__module__.startswith("transformers")
    exclude = list(q.exclude) or None
    if q.method in TORCHAO_METHODS:
        ao = torchao_config(q.method, q.granularity)
        if from_transformers:
            from transformers import TorchAoConfig

            return {"quantization_config": TorchAoConfig(ao, modules_to_not_convert=exclude)}
        from diffusers import TorchAoConfig as DiffusersTorchAoConfig

        return {"quantization_config": DiffusersTorchAoConfig(ao, modules_to_not_convert=exclude)}
    bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if q.method == "nf4" else {"load_in_8bit": True}
    if from_transformers:
        from transformers import BitsAndBytesConfig

        return {"quantization_config": BitsAndBytesConfig(**bnb, llm_int8_skip_modules=exclude)}
    from diffusers import BitsAndBytesConfig as DiffusersBnb

    return {"quantization_config": DiffusersBnb(**bnb, llm_int8_skip_modules=exclude)}
