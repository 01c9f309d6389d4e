"""``policies.attention.sparse``: the video's self-attention on a sparse layout (``kernels.sparse_video``), after the
phase's dense steps.

Three parts: a hook on each denoiser reads the call's token grid (the family's ``video_tokens`` target) and, on a
sparse step, makes its layout current for the call; a hook on each attention module of the target's roles sends the
SDPA calls over exactly the grid's tokens to the layout (other lengths, masked calls: as they were); a step policy
says which steps are sparse (a step's place in its phase, so a rollout and its replay agree). The attention hooks
are registered before the attention policy's, inside them, so the layout answers before any backend's redirect.

Under ``compile: regional`` per-module hooks would make every compiled block recompile, so the denoiser's hook runs a
sparse step's whole call inside one redirect instead (``SparseSDPA`` with the roles' head sizes), which dynamo traces
into each compiled block, FlexAttention's higher-order operator with it (inductor: its fused kernel): the blocks
compile once for the dense steps and once more for the sparse ones, whatever the number of steps. The redirect takes
the plain SDPA calls over exactly the grid's tokens (queries and keys) at those head sizes; the families' other
attentions attend to text, audio or image tokens, whose lengths differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..bridge import remove_hook
from ..kernels.sparse_video import VideoLayout, cached_layout
from ..spec import PipelineSpec, SpecError
from ..spec.policies import SparseAttention
from ..targets import AttentionTarget, VideoTokensTarget
from .attention import head_shape
from .attention_kernels import SDPAMode
from .steps import StepPolicy

GRID_HOOK = "omnispec_sparse_grid"
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
ATTENTION_HOOK = "omnispec_sparse_attention"


class SparseState:
    """What the hooks share: whether this step is sparse, and the layout of the current denoiser call."""

    def __init__(self, settings: SparseAttention):
        self.settings = settings
        self.sparse_step = False
        self.layout: VideoLayout | None = None

    def call_layout(self, target: VideoTokensTarget, module: torch.nn.Module, args: tuple,
                    kwargs: dict) -> VideoLayout:
        """The layout of a denoiser call's token grid (built once per grid and settings)."""
        grid = tuple(int(n) for n in target.grid(module, args, kwargs))
        s = self.settings
        return cached_layout(s.kind, grid, s.tile, s.window, str(next(module.parameters()).device))


class GridHook(ModelHook):
    """Around a denoiser call: on a sparse step, the layout of the call's token grid is current."""

    def __init__(self, state: SparseState, target: VideoTokensTarget):
        super().__init__()
        self.state, self.target = state, target

    def new_forward(self, module, *args, **kwargs):
        if not self.state.sparse_step:
            return self.fn_ref.original_forward(*args, **kwargs)
        self.state.layout = self.state.call_layout(self.target, module, args, kwargs)
        try:
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:
            self.state.layout = None


class CompiledGridHook(ModelHook):
    """Under compile: around a denoiser call, on a sparse step, the whole call inside ``SparseSDPA`` over the call's
    layout, for the attention calls of ``head_sizes``; dynamo traces the mode into each compiled block."""

    def __init__(self, state: SparseState, target: VideoTokensTarget, head_sizes: frozenset[int]):
        super().__init__()
        self.state, self.target, self.head_sizes = state, target, head_sizes

    def new_forward(self, module, *args, **kwargs):
        if not self.state.sparse_step:
            return self.fn_ref.original_forward(*args, **kwargs)
        with SparseSDPA(self.state.call_layout(self.target, module, args, kwargs), self.head_sizes):
            return self.fn_ref.original_forward(*args, **kwargs)


class SparseSDPA(SDPAMode):
    """SDPA calls over exactly the layout's tokens (queries and keys alike, no mask) on the layout; with
    ``head_sizes``, only those of these head sizes."""

    def __init__(self, video: VideoLayout, head_sizes: frozenset[int] | None = None):
        super().__init__()
        self.video, self.head_sizes = video, head_sizes

    def on_sdpa(self, func, args, kwargs):
        call = dict(zip(_SDPA_ARGUMENTS, args)) | kwargs
        q, k, v = call["query"], call["key"], call["value"]
        plain = not any(call.get(name) for name in ("attn_mask", "dropout_p", "is_causal", "enable_gqa"))
        n = self.video.tokens
        sized = self.head_sizes is None or q.shape[-1] in self.head_sizes
        if plain and sized and q.shape[-2] == k.shape[-2] == n and q.shape == k.shape == v.shape:
            return self.video.attend(q, k, v, call.get("scale"))
        return func(*args, **kwargs)


class LayoutHook(ModelHook):
    """Around an attention module of the target's roles: its SDPA calls under ``SparseSDPA`` when a layout is
    current."""

    def __init__(self, state: SparseState):
        super().__init__()
        self.state = state

    def new_forward(self, module, *args, **kwargs):
        video = self.state.layout
        with SparseSDPA(video) if video is not None else contextlib.nullcontext():
            return self.fn_ref.original_forward(*args, **kwargs)


class SparseSteps(StepPolicy):
    """A step is sparse once its place in its phase reaches ``dense_fraction``."""

    def __init__(self, state: SparseState):
        self.state = state

    @contextlib.contextmanager
    def step_context(self, run: Any, walk: Any, phase_run: Any, step: int):
        self.state.sparse_step = phase_run.plans[step].fraction >= self.state.settings.dense_fraction
        try:
            yield
        finally:
            self.state.sparse_step = False


def remove_sparse_attention(denoiser: torch.nn.Module) -> None:
    for module in denoiser.modules():
        remove_hook(module, ATTENTION_HOOK)
    remove_hook(denoiser, GRID_HOOK)


def apply_sparse_attention(spec: PipelineSpec, target: VideoTokensTarget | None, attention: AttentionTarget,
                           denoisers: Mapping[str, torch.nn.Module]) -> tuple[SparseSteps | None, str | None]:
    """Hook the denoisers (a rebuild over the same modules first removes an earlier build's hooks); returns the step
    policy and explain's note (None, None: off)."""
    for denoiser in denoisers.values():
        remove_sparse_attention(denoiser)
    settings = spec.policies.attention.sparse
    if settings is None:
        return None, None
    assert target is not None  # check_policies refused the family
    compiled = spec.policies.compile.mode != "none"  # regional: the spec refuses full
    state = SparseState(settings)
    hooked = 0
    for name, denoiser in denoisers.items():
        by_role = attention.modules(denoiser.named_modules())
        modules = [m for role in target.roles for _, m in by_role.get(role, [])]
        if not modules:
            raise SpecError.single(f"{name} has no attention module of the roles {', '.join(target.roles)}",
                                   "policies.attention.sparse")
        registry = HookRegistry.check_if_exists_or_initialize(denoiser)
        if compiled:
            head_sizes = frozenset(head_shape(m, attention)[1] for m in modules)
            registry.register_hook(CompiledGridHook(state, target, head_sizes), GRID_HOOK)
        else:
            for module in modules:
                HookRegistry.check_if_exists_or_initialize(module).register_hook(LayoutHook(state), ATTENTION_HOOK)
            registry.register_hook(GridHook(state, target), GRID_HOOK)
        hooked += len(modules)
    window = "x".join(map(str, settings.window))
    how = ("compiled in, through one redirect around the denoiser's call" if compiled
           else "a hook on each attention module")
    note = (f"approximate: {settings.kind} sparse attention on {hooked} {'/'.join(target.roles)} attention modules, "
            f"tiles {'x'.join(map(str, settings.tile))}, window {window}, dense for the first "
            f"{settings.dense_fraction:.0%} of each phase's steps (FlexAttention; {how})")
    return SparseSteps(state), note
