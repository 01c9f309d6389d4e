"""Attention backends per role: explicit (checked by a real call at build) or ``auto`` (timed on first use).

Mechanism: every attention module of a role gets a diffusers ``ModelHook`` that runs its forward inside the
backend's context (``attention_kernels.backend_context``: ``sdpa_kernel`` for the ``sdpa_*`` backends, a
``TorchFunctionMode`` that sends ``F.scaled_dot_product_attention`` to xformers, SageAttention or
FlashAttention-4 for the others). We do this instead of
diffusers' ``set_attention_backend`` because that dispatcher (a) reaches only processors written for
it (FLUX, Wan; not SD3's ``JointAttnProcessor2_0`` or the digits model's ``AttnProcessor2_0``) and (b)
refuses sageattention < 2.1.1, the only build on PyPI. Intercepting SDPA covers every processor alike.

Under compile per-module hooks would make every block recompile, so the only replacements allowed there, ``flash4``,
``sage`` and ``int8_fp8`` (operators compiled code can call), run through one redirect around the denoiser's call
(``CompiledRedirectHook``) that dynamo traces into each compiled block.

Forwards that may be differentiated (with gradients, a rollout's, a replay's: ``kernels.sdpa.may_train``) run
what a backward may follow: ``GradientSafeHook`` on each denoiser keeps cuDNN attention out of the dispatcher's
choice, ``auto`` chooses among the backends whose trial forward and backward pass, and a named replacement kernel is
tried forward and backward at each call shape before it runs there. A rollout and its replays share every choice.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from ..bridge import remove_hook
from ..kernels.sdpa import may_train, safe_sdpa
from ..spec import PipelineSpec, SpecError
from ..spec.attention_plan import SAFE_SDPA, approximation, auto_as_sdpa, training_backend
from ..spec.errors import Problem
from ..spec.policies import PERTURBABLE_BACKENDS
from ..targets import AttentionTarget
from .attention_fallback import fall_back, guarded_forward
from .attention_kernels import (
    APPROXIMATE,
    AUTO_EXCLUDED,
    CONCRETE,
    GRADIENT_SAFE,
    NOT_FOR_GRADIENTS,
    backend_context,
    gradient_safe_context,
    redirect_mode,
    usable,
)

HOOK_NAME = "omnispec_attention"
# The hook on each denoiser that puts its forwards that may be differentiated under ``GradientSafeSDPA``.
GRADIENTS_HOOK = "omnispec_attention_gradients"
# Where an attention module keeps the processor ``fused_qk_norm_rope`` replaced, for a rebuild to put it back.
REPLACED_PROCESSOR = "omnispec_replaced_processor"
# auto keeps sdpa unless another backend is faster by more than this (timing noise on a short trial).
AUTO_MARGIN = 0.03


# ---- hooks ----------------------------------------------------------------------------------------

class GradientSafeHook(ModelHook):
    """Around a denoiser's call: where the forward may be differentiated (``kernels.sdpa.may_train``), its SDPA
    calls run with cuDNN attention off unless a role named it (``GradientSafeSDPA``)."""

    def new_forward(self, module, *args, **kwargs):
        with gradient_safe_context():
            return self.fn_ref.original_forward(*args, **kwargs)


class FixedBackendHook(ModelHook):
    """A role's named backend. Where the forward may be differentiated, a backend whose backward torch does not
    train with everywhere first passes a trial forward and backward at the call's shape; a shape that fails it runs
    on SDPA with cuDNN attention off (one warning), in the rollout and its replays alike."""

    def __init__(self, role: str, backend: str, heads: int, head_dim: int):
        super().__init__()
        self.role, self.backend, self.heads, self.head_dim = role, backend, heads, head_dim

    def new_forward(self, module, *args, **kwargs):
        train = may_train()
        backend = self.backend
        if train and backend not in GRADIENT_SAFE:
            hidden, tokens = call_shape(module, args, kwargs)
            if not passes_gradient_trial(backend, hidden.shape[0], self.heads, tokens, self.head_dim, hidden.dtype,
                                         hidden.device):
                backend = "sdpa"
        return guarded_forward(self.fn_ref.original_forward, backend, args, kwargs, torch.is_grad_enabled())


class CompiledRedirectHook(ModelHook):
    """Under compile: the denoiser's whole call inside one redirect of plain SDPA calls of ``head_sizes`` to a
    replacement kernel (``flash4``, ``sage`` or ``int8_fp8``, operators compiled code can call). Dynamo traces the
    mode into each compiled block; per-module hooks would make it recompile every block. A call shape FA4 refuses
    falls back to SDPA inside its operators (``flash4.py``), as in eager runs; sage's and int8_fp8's dtypes and head
    sizes are checked at build."""

    def __init__(self, backend: str, head_sizes: frozenset[int]):
        super().__init__()
        self.backend, self.head_sizes = backend, head_sizes

    def new_forward(self, module, *args, **kwargs):
        with redirect_mode(self.backend, self.head_sizes):
            return self.fn_ref.original_forward(*args, **kwargs)


# Process-wide cache of auto choices: (role, heads, tokens, head size, dtype, device, may train) -> backend.
AUTO_CHOICES: dict[tuple, str] = {}
# Process-wide results of trial forwards and backwards: (backend, heads, tokens, head size, dtype, device) -> passed.
GRADIENT_TRIALS: dict[tuple, bool] = {}


def _trial_input(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 grad: bool) -> torch.Tensor:
    """Random (B, H, L, D) attention input laid out as diffusers' processors hand it to SDPA (heads split out of
    a (B, L, H*D) projection, then transposed): a kernel's support can depend on strides, not only on shapes."""
    q = torch.randn(batch, tokens, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    return q.requires_grad_(grad)


def _trial(backend: str, q: torch.Tensor) -> None:
    """One call under ``backend``; with ``q.requires_grad``, a forward and its backward (a backend that can't
    differentiate this call raises here, on a trial, not in a training step)."""
    with backend_context(backend):
        out = F.scaled_dot_product_attention(q, q, q)
    if q.requires_grad:
        (grad,) = torch.autograd.grad(out.sum(), q)
        if not bool(torch.isfinite(grad).all()):
            raise RuntimeError(f"{backend} gave non-finite gradients in a trial")


def _time_backend(backend: str, q: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one ``_trial`` (after one untimed)."""
    _trial(backend, q)
    times = []
    for _ in range(repeats):
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _trial(backend, q)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def passes_gradient_trial(backend: str, batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> bool:
    """Whether ``backend`` runs a forward and a backward of this attention shape here (tried once per process, at
    the first call's batch); a failure is warned once and its calls run on SDPA with cuDNN attention off."""
    key = (backend, heads, tokens, head_dim, dtype, str(device))
    if key not in GRADIENT_TRIALS:
        q = _trial_input(batch, heads, tokens, head_dim, dtype, device, grad=True)
        try:
            with torch.enable_grad(), safe_sdpa():
                _trial(backend, q)
            GRADIENT_TRIALS[key] = True
        except (RuntimeError, NotImplementedError) as exc:
            fall_back((backend, (batch, heads, tokens, head_dim), dtype, "trial", True), exc)
            GRADIENT_TRIALS[key] = False
    return GRADIENT_TRIALS[key]


def choose(role: str, candidates: list[str], batch: int, heads: int, tokens: int, head_dim: int,
           dtype: torch.dtype, device: torch.device, train: bool = False) -> str:
    """The fastest candidate for this attention shape (sdpa unless another beats it by ``AUTO_MARGIN``), timed once
    per process by the first call of that shape, at that call's batch.

    ``train``: the forward may be differentiated (``kernels.sdpa.may_train``: gradients on, or a rollout or a
    replay). Then the trial is a forward and a backward, sdpa_cudnn is no candidate, and sdpa is SDPA with cuDNN
    attention off; the choice is kept apart from the one without (generation), and shared by a rollout and all its
    replays, with or without gradients and in micro-batches of any size: a replay must run the forward kernel its
    rollout ran, or its log-probs move."""
    key = (role, heads, tokens, head_dim, dtype, str(device), train)
    if train:
        candidates = [b for b in candidates if b not in NOT_FOR_GRADIENTS]
    if key not in AUTO_CHOICES:
        if len(candidates) == 1:
            AUTO_CHOICES[key] = candidates[0]
        else:
            q = _trial_input(batch, heads, tokens, head_dim, dtype, device, train)
            times = {}
            with torch.set_grad_enabled(train), safe_sdpa() if train else contextlib.nullcontext():
                for b in candidates:
                    try:
                        times[b] = _time_backend(b, q)
                    except (RuntimeError, NotImplementedError):  # a kernel that can't take this shape
                        times[b] = float("inf")
            del q
            best = min(times, key=times.get)
            AUTO_CHOICES[key] = best if times[best] < times["sdpa"] * (1 - AUTO_MARGIN) else "sdpa"
    return AUTO_CHOICES[key]


def call_shape(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, int]:
    """An attention module's hidden states and the tokens its attention spans (a joint attention's text tokens
    too)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    context = kwargs.get("encoder_hidden_states")
    joint = context is not None and hidden.ndim == 3 and getattr(module, "added_kv_proj_dim", None)
    return hidden, hidden.shape[1] + (context.shape[1] if joint else 0)


class AutoBackendHook(ModelHook):
    """Picks the fastest usable backend for each call shape on first use (cached for the process)."""

    def __init__(self, role: str, candidates: list[str], heads: int, head_dim: int):
        super().__init__()
        self.role, self.candidates, self.heads, self.head_dim = role, candidates, heads, head_dim

    def new_forward(self, module, *args, **kwargs):
        hidden, tokens = call_shape(module, args, kwargs)
        backend = choose(self.role, self.candidates, hidden.shape[0], self.heads, tokens, self.head_dim,
                         hidden.dtype, hidden.device, may_train())
        return guarded_forward(self.fn_ref.original_forward, backend, args, kwargs, torch.is_grad_enabled())


# ---- the policy -----------------------------------------------------------------------------------

@dataclass
class AttentionPlan:
    """What runs per role without gradients (``per_role``, why in ``notes``) and where a forward may be differentiated
    (``training``: with gradients, in rollouts and in replays; why in ``training_notes``): shown by ``explain``."""

    per_role: dict[str, str] = field(default_factory=dict)
    training: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    training_notes: dict[str, str] = field(default_factory=dict)


def head_shape(module: torch.nn.Module, target: AttentionTarget) -> tuple[int, int]:
    """An attention module's (heads, head size): the family's reading where it gives one, else diffusers' fields."""
    if target.head_shape is not None:
        return target.head_shape(module)
    heads = int(getattr(module, "heads", 1))
    inner = getattr(module, "inner_dim", None) or module.to_q.out_features
    return heads, int(inner) // heads


def _fuse_qk_norm_rope(target: AttentionTarget, role: str, modules: list[tuple[str, torch.nn.Module]],
                       plan: AttentionPlan) -> None:
    """Give each of a role's attentions the family's fused q/k norm + RoPE processor, calling ``qk_norm_rope``."""
    from ..kernels.qk_norm_rope import qk_norm_rope  # registers the operator: only when a spec asks for it

    fused = 0
    for _, module in modules:
        if (processor := target.qk_norm_rope_processor(module.processor, qk_norm_rope)) is not None:
            module.__dict__[REPLACED_PROCESSOR] = module.processor
            module.set_processor(processor)
            fused += 1
    plan.notes[f"{role} q/k norm + RoPE"] = (
        f"fused in {fused} of {len(modules)} attentions (one operator for q and k: a Triton kernel on CUDA, the "
        "model's own operations elsewhere)" + ("" if fused == len(modules) else "; the others keep processors "
                                              "of their own"))


def unfused_attention(module: torch.nn.Module) -> None:
    """Undo what a build did to one attention module: its backend hook removed, the processor ``fused_qk_norm_rope``
    replaced put back (a module a build never touched stays as it is)."""
    remove_hook(module, HOOK_NAME)
    if (replaced := module.__dict__.pop(REPLACED_PROCESSOR, None)) is not None:
        module.set_processor(replaced)


def apply_attention(spec: PipelineSpec, target: AttentionTarget, denoisers: Mapping[str, torch.nn.Module],
                    device: torch.device) -> AttentionPlan:
    plan = AttentionPlan()
    problems: list[Problem] = []
    compiled = spec.policies.compile.mode != "none"
    for dname, denoiser in denoisers.items():
        for name in (HOOK_NAME, GRADIENTS_HOOK):
            remove_hook(denoiser, name)
        traced: set[int] = set()  # head sizes the named kernel takes under compile, through one hook on the denoiser
        for role, modules in target.modules(denoiser.named_modules()).items():
            for _, module in modules:  # a rebuild over the same modules starts clean
                unfused_attention(module)
            if spec.policies.attention.fused_qk_norm_rope:
                _fuse_qk_norm_rope(target, role, modules, plan)
            hook_for = _plan_role(spec, target, role, dname, modules[0][1], denoiser.dtype, device, plan, problems)
            if hook_for is None:
                continue
            if compiled:  # the spec rules let only flash4, sage or int8_fp8, named for every role, reach here
                traced.add(head_shape(modules[0][1], target)[1])
                plan.notes[role] += "; compiled in, through one redirect around the denoiser's call"
                continue
            for _, module in modules:
                HookRegistry.check_if_exists_or_initialize(module).register_hook(hook_for(), HOOK_NAME)
        registry = HookRegistry.check_if_exists_or_initialize(denoiser)
        if traced:
            registry.register_hook(CompiledRedirectHook(spec.policies.attention.default, frozenset(traced)), HOOK_NAME)
        registry.register_hook(GradientSafeHook(), GRADIENTS_HOOK)
    if problems:
        raise SpecError(problems)
    return plan


def _plan_role(spec: PipelineSpec, target: AttentionTarget, role: str, denoiser: str, module: torch.nn.Module,
               dtype: torch.dtype, device: torch.device, plan: AttentionPlan,
               problems: list[Problem]) -> Callable[[], ModelHook] | None:
    """Decide one role's backend with and without gradients into ``plan`` (a problem into ``problems``); the hook
    each of its attention modules gets, or None where plain SDPA needs none (``GradientSafeHook`` on the denoiser
    then keeps cuDNN attention out of its forwards that may be differentiated)."""
    policy = spec.policies.attention
    key = target.role_key(role, policy.per_role)
    wanted = policy.per_role[key] if key else policy.default
    heads, head_dim = head_shape(module, target)
    compiled = spec.policies.compile.mode != "none"
    hook_for: Callable[[], ModelHook] | None = None
    if wanted == "auto" and (forced := auto_as_sdpa(spec)) is not None:
        plain, trained, note = "sdpa", "sdpa", f"sdpa ({forced})"
    elif wanted == "auto":
        perturbing = any(p.guidance.perturbs_attention for p in spec.recipe.phases)
        allowed = [b for b in CONCRETE if (not perturbing or b in PERTURBABLE_BACKENDS)
                   and (policy.approximate or b not in APPROXIMATE) and b not in AUTO_EXCLUDED]
        reasons = {b: usable(b, device, dtype, head_dim) for b in allowed}
        candidates = [b for b in allowed if reasons[b] is None]
        if "sdpa" not in candidates:
            candidates.insert(0, "sdpa")
        skipped = ", ".join(f"{b} ({r})" for b, r in reasons.items() if r)
        plain = trained = "auto"
        note = (f"auto over [{', '.join(candidates)}], timed per shape on first use"
                + (f" (unusable here: {skipped})" if skipped else ""))
        training_candidates = ", ".join(b for b in candidates if b not in NOT_FOR_GRADIENTS)
        plan.per_role[role] = plan.training[role] = "auto"
        plan.notes[role] = note
        plan.training_notes[role] = (f"auto over [{training_candidates}], timed forward and backward per shape "
                                            f"on first use, one choice shared by a rollout and its replays (sdpa "
                                            f"there is {SAFE_SDPA})")
        return lambda: AutoBackendHook(role, candidates, heads, head_dim)
    else:
        reason = usable(wanted, device, dtype, head_dim)
        where = f"policies.attention.{'per_role.' + key if key else 'default'}"
        if reason is not None and not policy.allow_fallback:
            problems.append(Problem(where, f"{wanted} cannot run for role {role!r} of {denoiser} ({dtype}, head size "
                                    f"{head_dim}, {device}): {reason}"))
            return None
        if reason is not None:
            plain, note = "sdpa", f"sdpa (fallback: {wanted} unusable: {reason})"
        elif wanted == "sdpa":
            plain, note = wanted, "sdpa: torch's dispatcher picks the kernel"
        else:
            plain, note = wanted, f"{wanted} (explicit, {approximation(wanted)}checked by a test call on {device})"
        trained = plain
        if plain != "sdpa":
            hook_for = lambda: FixedBackendHook(role, plain, heads, head_dim)
    plan.per_role[role], plan.training[role] = plain, trained
    plan.notes[role] = note
    plan.training_notes[role] = training_backend(trained, compiled)
    return hook_for
