"""Compilation: ``regional`` compiles each denoiser's repeated blocks (diffusers' ``compile_repeated_blocks``,
falling back to the family's block lists), ``full`` the whole denoiser; ``vae`` also compiles each VAE's decoder
whole. Compilation happens lazily on the first call: benchmarks warm up before timing.

``cudagraphs`` records what is compiled as CUDA graphs (inductor's CUDA-graph trees): each block (regional) or the
whole denoiser call (full, one graph a step: no launches, no copies of block inputs, no eager embedders between
graphs). Regional: what every block reads from outside the graphs (its blocks target's ``shared_inputs``, the rotary
embedding) is kept in static storage written once a step, not copied into each block's graph (``KeptBlockInputs``).
Every denoiser call without gradients starts a new generation of the graphs (``cudagraph_mark_step_begin``, outside
the compiled code), so a call may reuse the graph memory of the one before it, unless a forward with gradients still
waits for its backward (an RL replay's: ``start_graph_generation``). Regional: the denoiser's output comes
from its uncompiled output layers, in memory of its own. Full: the output is graph memory, so each call hands out a
copy (one latent's worth, a few µs) that the next replay cannot overwrite.

``eager_rounding`` (default on, inductor only) keeps eager's low-precision roundings inside fused kernels. Inductor
otherwise keeps a fused intermediate in float32 in an inference graph but saves it rounded in a training graph, so a
rollout (no gradients) and its replay with gradients would compute different log-probs under compile.
``fixed_reductions`` (default on unless ``autotune``) is the same promise for sums: inductor times a reduction
kernel's candidate launch configurations at its first launch unless told to pick by rule (``deterministic``), and the
configuration sets the order a row adds up in; the inference and training kernels of one norm are timed apart.
``persistent_rows`` (4,096 by default) lets a norm over a longer row than inductor's 1,024 elements read it once
(``kernels.inductor_rows``). Inductor's coordinate-descent tuning of its kernels' launches, which cache-dit turns
on, is not offered: under fixed reductions it made none of FLUX.1-dev's norms faster (BENCHMARKS.md, "Inductor
options: eager rounding, fixed reductions, rows read once")."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .. import bridge
from ..kernels import torch_internals
from ..kernels.torch_internals import tree_flatten, tree_map_only, tree_unflatten
from ..spec import PipelineSpec, SpecError
from ..spec.policies import INDUCTOR_PERSISTENT_ROWS
from ..targets import BlocksTarget


def backend_problem(spec: PipelineSpec) -> str | None:
    """Why the compile policy's backend cannot compile here (torch knows no backend of that name: its own and those
    installed packages register), or None; checked before any weight loads, since torch says so only at the first
    compiled call."""
    policy = spec.policies.compile
    if policy.mode == "none":
        return None
    if policy.backend in torch.compiler.list_backends(exclude_tags=()):  # debugging backends (eager ...) too
        return None
    return (f"torch knows no compile backend {policy.backend!r}: it has {', '.join(torch.compiler.list_backends())} "
            "and debugging ones (eager, aot_eager ...)")


def apply_compile(spec: PipelineSpec, blocks: BlocksTarget, components: dict[str, Any]) -> str:
    policy = spec.policies.compile
    for name, c in spec.model.components.items():  # a rebuild over the same modules starts from them uncompiled
        if c.role in ("denoiser", "vae") and hasattr(components.get(name), "modules"):
            uncompiled(components[name])
    if policy.mode == "none":
        return "none"
    if policy.rows_read_once:
        from ..kernels.inductor_rows import foreign_choices

        if in_the_way := foreign_choices():
            if policy.persistent_rows is not None:
                raise SpecError.single(f"persistent_rows changes inductor's own heuristics, and {in_the_way}",
                                       "policies.compile.persistent_rows")
            # the default steps aside for heuristics someone installed on purpose
            policy = policy.model_copy(update={"persistent_rows": INDUCTOR_PERSISTENT_ROWS})
    kwargs: dict[str, Any] = {"fullgraph": policy.fullgraph, "dynamic": policy.dynamic, "backend": policy.backend}
    if policy.backend == "inductor" and (options := _torch_compile_options(policy)):
        kwargs["options"] = options
    _allow_block_variants()
    split, kept = 0, []
    for name, c in spec.model.components.items():
        if c.role != "denoiser":
            continue
        module = components[name]
        if policy.mode == "full" and policy.cudagraphs:
            _compile_whole_as_graph(module, kwargs)
        elif policy.mode == "full":
            module.compile(**kwargs)
        else:
            _compile_blocks(name, module, blocks, kwargs)
            if spec.policies.parallel.sequence > 1 and policy.fullgraph:
                split += _split_blocks_with_breaks(module, kwargs)
            if policy.cudagraphs:
                _new_generation_per_call(module)
                kept += _keep_shared_block_inputs(module, blocks)
        _mark_compiled(module)
    options = "".join(f", {name}" for name in ("cudagraphs", "autotune") if getattr(policy, name))
    if split:
        options += f", graph breaks in the {split} block(s) whose inputs sequence parallelism splits"
    if kept:
        options += f", {', '.join(dict.fromkeys(kept))} kept in place for the blocks' graphs"
    if policy.backend == "inductor":
        options += ", eager rounding" if policy.eager_rounding else ""
        options += ", fixed reductions" if policy.reductions_fixed else ""
        rows = policy.rows_read_once
        options += f", norms read once up to {rows} elements" if rows else ", inductor's own norm kernels"
    decoders = _compile_vae_decoders(spec, components, policy) if policy.vae else ""
    dynamic = "automatic" if policy.dynamic is None else policy.dynamic
    return (f"{policy.mode} (backend {policy.backend}, fullgraph {policy.fullgraph}, dynamic {dynamic}{options})"
            + decoders)


def _compile_blocks(name: str, module: Any, target: BlocksTarget, kwargs: dict[str, Any]) -> None:
    if bridge.has_repeated_blocks(module):
        module.compile_repeated_blocks(**kwargs)
        return
    blocks = target.blocks(module)
    if not blocks:
        raise SpecError.single(f"{name} has no repeated blocks to compile regionally", "policies.compile.mode")
    for block in blocks:
        block.compile(**kwargs)


def _split_blocks_with_breaks(module: Any, kwargs: dict[str, Any]) -> int:
    """Recompile, with graph breaks allowed, the compiled blocks whose inputs diffusers' context parallelism splits
    (Wan's and Qwen-Image's first block): its hook runs inside the block's forward and reads the forward's signature
    on every call, which dynamo cannot trace, so a full graph of such a block fails at its first call. The other
    blocks stay whole graphs. Returns how many."""
    hooked = [m for m in bridge.context_parallel_split_modules(module) if getattr(m, "_compiled_call_impl", None)]
    for block in hooked:
        block.compile(**{**kwargs, "fullgraph": False})
    return len(hooked)


def _compile_whole_as_graph(module: Any, kwargs: dict[str, Any]) -> None:
    """Compile ``module``'s whole call for CUDA graphs. Not ``Module.compile``: its forward hooks run inside the
    compiled code, and a new graph generation has to start outside it. Without gradients the call starts one
    (``start_graph_generation``) and returns a copy of the outputs, which the next call's replay would otherwise
    overwrite; with gradients (an RL replay) neither, as for regional graphs: the trees keep what a pending backward
    needs."""
    compiled = torch.compile(module._call_impl, **kwargs)

    def call(*args: Any, **kw: Any) -> Any:
        if torch.is_grad_enabled():
            return compiled(*args, **kw)
        start_graph_generation(module)
        return tree_map_only(torch.Tensor, torch.clone, compiled(*args, **kw))

    module._compiled_call_impl = call


def _compile_vae_decoders(spec: PipelineSpec, components: dict[str, Any], policy: Any) -> str:
    """Compile the ``decoder`` of every VAE component whole; returns explain's note. Not full-graph: video VAEs
    decode chunk by chunk through caches of their own, where a break is better than a refusal. No CUDA graphs: a
    decoder's output is the run's result, which the next decode's graph replay would overwrite. ``policy``: the
    compile policy as ``apply_compile`` settled it (its default rows bound may have given way)."""
    kwargs: dict[str, Any] = {"fullgraph": False, "dynamic": policy.dynamic, "backend": policy.backend}
    without_graphs = policy.model_copy(update={"cudagraphs": False})  # its mode's other options (autotune) stay
    if policy.backend == "inductor" and (options := _torch_compile_options(without_graphs)):
        kwargs["options"] = options
    compiled = []
    for name, c in spec.model.components.items():
        decoder = getattr(components.get(name), "decoder", None) if c.role == "vae" else None
        if isinstance(decoder, torch.nn.Module):
            decoder.compile(**kwargs)
            _mark_compiled(decoder)
            compiled.append(name)
    if not compiled:
        raise SpecError.single("no VAE component here has a decoder to compile", "policies.compile.vae")
    return f"; VAE decoders compiled: {', '.join(compiled)}"


def _mark_compiled(module: Any) -> None:
    """Mark what this build compiled (``Module.compile``'s forwards), which the next build over the module undoes."""
    for sub in module.modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            sub._omnispec_compiled = True


def _torch_compile_options(policy: Any) -> dict[str, Any]:
    """torch.compile's inductor options for the policy: its mode's (torch.compile takes a mode or options, not both,
    so the mode goes in as the options inductor lists for it), eager's roundings kept where asked, the graph pass
    that stores a dynamic fp8 quantization's input narrow (``compile_passes``), and the pass that carries
    ``persistent_rows`` (``compile_rows``)."""
    from ..kernels.inductor_passes import (
        NarrowQuantizedInputs,  # imports inductor's graph-pass machinery: only when compiling
    )
    from ..kernels.torch_internals import inductor_config, list_mode_options

    options = dict(list_mode_options(policy.inductor_mode)) if policy.inductor_mode else {}
    if policy.eager_rounding:
        options["emulate_precision_casts"] = True
    if policy.reductions_fixed:
        options["deterministic"] = True
    options["post_grad_custom_pre_pass"] = NarrowQuantizedInputs(then=inductor_config.post_grad_custom_pre_pass)
    if rows := policy.rows_read_once:
        from ..kernels.inductor_rows import PersistentRows

        options["post_grad_custom_post_pass"] = PersistentRows(
            rows, then=inductor_config.post_grad_custom_post_pass)
    return options


# Graphs one compiled block's code may hold. Regional compile compiles a block class once per variant it meets: its
# configurations (SD3's dual-attention and last blocks), grad mode (a rollout without, its replay with gradients),
# LoRA-wrapped or quantized weights. Dynamo's default of 8 is met by SD3.5 with a LoRA replayed with gradients;
# past it a fullgraph compile fails the run, and a non-fullgraph one runs the block eagerly, whose numbers differ.
BLOCK_VARIANTS = 64


def _allow_block_variants() -> None:
    """Raise dynamo's per-code recompile limit (process-wide) to ``BLOCK_VARIANTS``, never lower it."""
    from ..kernels.torch_internals import dynamo_config as config

    config.recompile_limit = max(config.recompile_limit, BLOCK_VARIANTS)


def start_graph_generation(module: torch.nn.Module) -> None:
    """Start a new generation of the CUDA graphs (their memory free for the next replays), unless a compiled forward
    with gradients still waits for its backward: an exact RL replay runs, for each step, a forward without gradients
    (the rollout's values) after the forwards with them of the steps before, and the trainer's one backward comes
    after all of them; a new generation would hand their saved activations' memory to the next replay. CUDA-graph
    trees keep that state per device (``running_forwards_with_pending_backwards``, set by a forward with gradients,
    cleared by a backward); torch has no public reading of it."""
    weight = next(module.parameters(), None)
    if weight is not None and weight.device.type == "cuda":
        from ..kernels.torch_internals import get_manager

        index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        manager = get_manager(index, create_if_none_exists=False)
        if manager is not None and manager.running_forwards_with_pending_backwards:
            return
    torch.compiler.cudagraph_mark_step_begin()


def _new_generation_per_call(module: Any) -> None:
    """Each call without gradients starts a new generation of the CUDA graphs. With gradients (an RL replay) none is
    marked: the graph trees then keep the outputs a pending backward needs, which a marked step would give up."""

    def begin(_module: Any, _args: Any) -> None:
        if not torch.is_grad_enabled():
            start_graph_generation(_module)

    module._omnispec_cudagraph_generations = module.register_forward_pre_hook(begin)


SHARED_INPUTS_HOOK = "omnispec_shared_block_inputs"


class KeptBlockInputs(ModelHook):
    """On a denoiser module whose output every block reads (its blocks target's ``shared_inputs``: the rotary
    embedding), under regional CUDA graphs: without gradients, its output tensors copied into storage kept per place
    and shape and marked static (``torch._dynamo.mark_static_address``), so each block's graph reads them where they
    lie. Otherwise the graph trees copy such an input into every block's recorded input before each replay (FLUX.1:
    the rotary cos and sin, twice per block and step); this leaves one copy of each a step. With gradients the output
    passes as it is: a pending backward may read what a later forward would overwrite, and its graphs then copy as
    before. So does a second output of one place and shape within one denoiser call (``seen``, cleared as each call
    starts), which would overwrite the first while the blocks still read it."""

    KEEP = 8  # stored tensors, the least recently used dropped past it (a dropped shape's graphs record again)

    def __init__(self) -> None:
        super().__init__()
        self.storage: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self.seen: set[tuple[Any, ...]] = set()

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if torch.is_grad_enabled():
            return output
        leaves, layout = tree_flatten(output)
        kept = [self._kept(i, t) if isinstance(t, torch.Tensor) else t for i, t in enumerate(leaves)]
        return tree_unflatten(kept, layout)

    def _kept(self, place: int, tensor: torch.Tensor) -> torch.Tensor:
        key = (place, tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        if key in self.seen:
            return tensor
        self.seen.add(key)
        held = self.storage.pop(key, None)
        if held is None:
            with torch.inference_mode(False):  # writable in later calls, inside inference mode or not
                held = torch.empty_like(tensor)  # its strides, or contiguous where it overlaps itself (expanded)
            torch_internals.mark_static_address(held)
        self.storage[key] = held
        while len(self.storage) > self.KEEP:
            self.storage.popitem(last=False)
        return held.copy_(tensor)


def _keep_shared_block_inputs(module: Any, target: BlocksTarget) -> list[str]:
    """Hook the modules of ``module`` that ``target.shared_inputs`` names (``KeptBlockInputs``), each call of
    ``module`` clearing what they saw; returns the names hooked."""
    named = dict(module.named_modules())
    names = [name for name in target.shared_inputs if name in named]
    hooks = [KeptBlockInputs() for _ in names]
    for name, hook in zip(names, hooks, strict=True):
        HookRegistry.check_if_exists_or_initialize(named[name]).register_hook(hook, SHARED_INPUTS_HOOK)

    def clear(_module: Any, _args: Any) -> None:
        for hook in hooks:
            hook.seen.clear()

    if hooks:
        module._omnispec_shared_inputs_calls = module.register_forward_pre_hook(clear)
    return names


def uncompiled(module: Any) -> None:
    """``module`` and its blocks as an earlier build found them: the forwards that build compiled
    (``Module.compile``'s ``_compiled_call_impl``) plain again, its CUDA-graph hooks (generations, kept block inputs)
    gone; what the caller compiled before handing the module in stays."""
    for attribute in ("_omnispec_cudagraph_generations", "_omnispec_shared_inputs_calls"):
        if (handle := getattr(module, attribute, None)) is not None:
            handle.remove()
            setattr(module, attribute, None)
    for sub in module.modules():
        bridge.remove_hook(sub, SHARED_INPUTS_HOOK)
        if getattr(sub, "_omnispec_compiled", False):
            sub._compiled_call_impl = None
            sub._omnispec_compiled = False
