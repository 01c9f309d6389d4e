"""``PipelineSpec``: the whole run, and the checks that span its sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from .base import DEVICE_PATTERN, Seed, SpecModel
from .guidance import GUIDANCE
from .model import ROLES, WEIGHTLESS_ROLES, ModelSpec
from .policies import CACHES, COMPILED_REPLACEMENTS, KERNEL_POLICIES, OFFLOADS, PERTURBABLE_BACKENDS, Policies
from .recipe import IMAGE_TASKS, SAMPLERS, ImageInput, LatentUpsample, PreviousInput, Recipe
from .schedule import FROM_CHECKPOINT, SCHEDULES, SHARED_SCHEDULES, SegmentSchedule

Loc = tuple[str | int, ...]


class RuntimeSpec(SpecModel):
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    seed: Seed = 0
    max_batch: int | None = Field(default=None, ge=1, description="Most samples x passes in one denoiser forward.")
    max_tokens_per_forward: int | None = Field(
        default=32768, ge=1,
        description="Batch guidance passes into one forward only while rows x image tokens stay within this: past "
        "it a batched forward of long video sequences is no faster than its rows one by one, and needs more memory.",
    )
    progress: bool = True
    threads: int | None = Field(default=None, ge=1, le=1024, description=(
        "Torch threads on a CPU device. Unset: torch's count, lowered to the cores the machine's load leaves free "
        "(on a busy machine more threads than free cores make each step many times slower), unless OMP_NUM_THREADS "
        "sets it."))
    encoding_cache_bytes: int | None = Field(default=None, ge=0, description=(
        "Most bytes of prompt encodings a pipeline keeps for reuse (least recently used dropped first); 0 keeps "
        "none. Unset: 1% of the device's memory (of the host's on a CPU)."))


class PipelineSpec(SpecModel):
    omnispec: Literal[1] = 1
    name: str = Field(min_length=1)
    extends: None = Field(default=None, description="Resolved by the loader; never left in a loaded spec.")
    model: ModelSpec
    recipe: Recipe
    policies: Policies = Field(default_factory=Policies)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineSpec:
        problems = list(_cross_field_problems(self))
        if problems:
            raise ValidationError.from_exception_data(
                "PipelineSpec",
                [
                    InitErrorDetails(type=PydanticCustomError("spec_rule", msg), loc=loc, input=None)
                    for loc, msg in problems
                ],
            )
        return self


for _kinds in (GUIDANCE, CACHES, OFFLOADS, SAMPLERS, SCHEDULES, SHARED_SCHEDULES, KERNEL_POLICIES):
    _kinds.held_by(PipelineSpec)


def _cross_field_problems(spec: PipelineSpec):  # noqa: C901 - one flat list of rules reads best
    components = spec.model.components
    phases = spec.recipe.phases

    def role_problem(loc: Loc, name: str, role: str):
        if name not in components:
            return loc, f"{name!r} is not a component (have: {', '.join(components)})"
        if components[name].role != role:
            return loc, f"component {name!r} has role {components[name].role!r}, expected {role!r}"
        return None

    names = [p.name for p in phases]
    for i, phase in enumerate(phases):
        base: Loc = ("recipe", "phases", i)
        if names.count(phase.name) > 1:
            yield base + ("name",), f"phase name {phase.name!r} is used more than once"
        if problem := role_problem(base + ("denoiser",), phase.denoiser, "denoiser"):
            yield problem
        if phase.adapter is not None and phase.adapter not in spec.model.adapters:
            yield base + ("adapter",), f"adapter slot {phase.adapter!r} is not declared in model.adapters"
        if isinstance(phase.input, PreviousInput):
            if i == 0:
                yield base + ("input", "kind"), "the first phase has no previous phase; its input must be 'initial'"
            transform = phase.input.transform
            if isinstance(transform, LatentUpsample) and transform.upsampler is not None:
                if problem := role_problem(base + ("input", "transform", "upsampler"), transform.upsampler, "upsampler"):
                    yield problem
        if isinstance(phase.input, ImageInput):
            if i != 0:
                yield base + ("input", "kind"), "only the first phase can start from the request's image"
            if spec.recipe.task not in IMAGE_TASKS:
                yield base + ("input", "kind"), f"task {spec.recipe.task!r} has no image to start from"
            if spec.recipe.defaults.strength is None:
                yield ("recipe", "defaults", "strength"), "an image input phase needs a default strength"
        if phase.sampler.stochastic and spec.policies.cache.hooked:
            yield base + ("sampler", "kind"), (
                f"the {spec.policies.cache.kind} cache (policies.cache.kind) decides per step from state a replay "
                "cannot rebuild, so stochastic steps would not replay exactly; use cache kind step_mask (computing "
                "every stochastic step) or none")
        schedule = phase.schedule
        if schedule.scheduler_component is not None:
            if problem := role_problem(base + ("schedule", "component"), schedule.scheduler_component, "scheduler"):
                yield problem
        if (of := schedule.segment_of) is not None:
            if of not in spec.recipe.schedules:
                have = ", ".join(spec.recipe.schedules) or "none"
                yield base + ("schedule", "of"), f"{of!r} is not in recipe.schedules (have: {have})"
            elif isinstance(phase.input, PreviousInput) and phases[i - 1].schedule.segment_of == of:
                yield base + ("input",), "a segment continuing the previous phase's schedule takes its latents as they are"
    yield from _segment_problems(spec)
    for name, shared in spec.recipe.schedules.items():
        if shared.scheduler_component is not None:
            if problem := role_problem(("recipe", "schedules", name, "component"), shared.scheduler_component,
                                       "scheduler"):
                yield problem

    if spec.recipe.defaults.strength is not None and not isinstance(phases[0].input, ImageInput):
        yield ("recipe", "defaults", "strength"), "strength applies to an image input, and the first phase's input is " \
            f"{phases[0].input.kind!r}"
    if spec.recipe.output_index() is None:
        yield ("recipe", "output", "phase"), f"{spec.recipe.output.phase!r} names no phase (have: {', '.join(names)})"

    for slot, adapter in spec.model.adapters.items():
        if adapter.target is not None and adapter.target not in components:
            yield ("model", "adapters", slot, "target"), f"{adapter.target!r} is not a component"

    defaults, constraints = spec.recipe.defaults, spec.recipe.constraints
    for msg in constraints.size_problems(defaults.height, defaults.width):
        yield ("recipe", "defaults"), msg
    for msg in constraints.frames_problems(defaults.frames):
        yield ("recipe", "defaults", "frames"), msg
    if (
        constraints.max_sequence_length is not None
        and defaults.max_sequence_length is not None
        and defaults.max_sequence_length > constraints.max_sequence_length
    ):
        yield ("recipe", "defaults", "max_sequence_length"), f"above constraints.max_sequence_length {constraints.max_sequence_length}"

    yield from _policy_problems(spec)
    yield from _scale_out_problems(spec)




def _segment_problems(spec: PipelineSpec):
    """Segments of one shared schedule must be adjacent phases whose ranges don't overlap."""
    phases = spec.recipe.phases
    seen: dict[str, list[int]] = {}
    for i, phase in enumerate(phases):
        if (of := phase.schedule.segment_of) is not None:
            seen.setdefault(of, []).append(i)
    for of, idx in seen.items():
        if idx != list(range(idx[0], idx[0] + len(idx))):
            yield ("recipe", "phases", idx[-1], "schedule", "of"), f"segments of {of!r} must be consecutive phases"
        bounds = _segment_bounds([phases[i].schedule for i in idx])  # type: ignore[misc]
        if isinstance(bounds, str):
            yield ("recipe", "phases", idx[0], "schedule"), bounds
            continue
        ranges = sorted((lo, hi, i) for (lo, hi), i in zip(bounds, idx))
        for (_, hi_a, a), (lo_b, _, b) in zip(ranges, ranges[1:]):
            if lo_b < hi_a:
                yield ("recipe", "phases", b, "schedule"), f"segment overlaps phase {phases[a].name!r} of {of!r}"
            elif lo_b > hi_a:
                yield ("recipe", "phases", b, "schedule", "low"), f"gap [{hi_a:g}, {lo_b:g}) of {of!r} has no phase"
        if ranges[0][0] > 0.0 or ranges[-1][1] < 1.0:
            yield ("recipe", "phases", idx[0], "schedule"), f"the segments of {of!r} must cover [0, 1] together"


def _segment_bounds(segments: list[SegmentSchedule]) -> list[tuple[float, float]] | str:
    """Numeric bounds for the coverage checks: a ``from_checkpoint`` boundary must end one segment and start
    the next, and stands for a value between their other bounds (whatever the checkpoint says)."""
    ends = [k for k, s in enumerate(segments) if s.high == FROM_CHECKPOINT]
    starts = [k for k, s in enumerate(segments) if s.low == FROM_CHECKPOINT]
    if not ends and not starts:
        return [(float(s.low), float(s.high)) for s in segments]  # type: ignore[arg-type]
    if len(ends) != 1 or len(starts) != 1:
        return "from_checkpoint must be the high bound of one segment and the low bound of one other"
    below, above = segments[ends[0]].low, segments[starts[0]].high
    assert isinstance(below, float) and isinstance(above, float)
    if below >= above:
        return f"the segments around the checkpoint's boundary leave no room for it ({below:g} .. {above:g})"
    placeholder = (below + above) / 2
    return [(placeholder if s.low == FROM_CHECKPOINT else float(s.low),  # type: ignore[arg-type]
             placeholder if s.high == FROM_CHECKPOINT else float(s.high)) for s in segments]  # type: ignore[arg-type]


def _policy_problems(spec: PipelineSpec):
    policies = spec.policies
    if policies.offload.streams_blocks and policies.compile.mode == "full":
        yield ("policies", "compile", "mode"), (
            f"full-graph compile cannot trace through {policies.offload.strategy} offload's hooks "
            "(policies.offload.strategy); use compile mode 'regional'"
        )
    if policies.compile.mode != "none" and policies.compile.fullgraph:
        # diffusers' offload and cache hooks call compiler-disabled functions (onload, cache decisions) from
        # inside the forwards being compiled: a full graph cannot contain them. Distributed offload onloads
        # through FSDP2's hooks instead, which compile with the blocks (tests/test_scale_out.py).
        if (policies.offload.streams_blocks and not getattr(policies.offload, "distributed", False)
                and policies.compile.mode == "regional"):
            yield ("policies", "compile", "fullgraph"), (
                f"{policies.offload.strategy} offload (policies.offload.strategy) onloads each block from a hook "
                "the compiler must not trace; set policies.compile.fullgraph: false (the block bodies still "
                "compile, with a graph break at each onload)")
        if policies.cache.hooked:
            yield ("policies", "compile", "fullgraph"), (
                f"the {policies.cache.kind} cache (policies.cache.kind) decides per step in hooks the compiler "
                "must not trace; set policies.compile.fullgraph: false, or use cache kind step_mask")
    if policies.compile.cudagraphs:
        # a CUDA graph replays the device addresses it recorded: weights moved after it, or a step's cached
        # tensors held until a later step (in graph memory the next replay overwrites), would be read stale
        if policies.offload.strategy != "none":
            yield ("policies", "compile", "cudagraphs"), (
                f"{policies.offload.strategy} offload (policies.offload.strategy) moves the weights between calls, "
                "and a CUDA graph replays the addresses it recorded; turn one of them off")
        if policies.cache.hooked:
            yield ("policies", "compile", "cudagraphs"), (
                f"the {policies.cache.kind} cache (policies.cache.kind) keeps block outputs from one step to a later "
                "one, which a CUDA graph's next replay overwrites; turn one of them off (step_mask, which reuses "
                "whole predictions, runs with it)")
        if policies.parallel.shard > 1:
            yield ("policies", "compile", "cudagraphs"), (
                "sharding (policies.parallel.shard) gathers each block's weights into new memory at every call, and a "
                "CUDA graph replays the addresses it recorded, so every block's graph would be recorded again at "
                "every call; turn one of them off")
    if policies.compile.mode != "none":
        chosen_backends = {("default",): policies.attention.default} | {
            ("per_role", r): b for r, b in policies.attention.per_role.items()}
        named = set(chosen_backends.values())
        for where, backend in chosen_backends.items():
            if backend in COMPILED_REPLACEMENTS and named != {backend}:
                yield ("policies", "attention", *where), (
                    f"under policies.compile.mode {policies.compile.mode!r} {backend} runs every attention of the "
                    "denoiser (one redirect around its call, which the compiler traces): name it as "
                    "policies.attention.default and give per_role no other backend")
            elif backend not in ("auto", "sdpa", *COMPILED_REPLACEMENTS):
                yield ("policies", "attention", *where), (
                    f"backend {backend!r} is applied by per-module hooks that make policies.compile.mode "
                    f"{policies.compile.mode!r} recompile every block; use auto, sdpa, flash4, sage or int8_fp8 with compile"
                )
    perturbing = [
        i for i, phase in enumerate(spec.recipe.phases) if phase.guidance.perturbs_attention
    ]
    if policies.attention.sparse is not None:
        yield from _sparse_problems(spec, perturbing)
    if perturbing:
        chosen = {("default",): policies.attention.default} | {
            ("per_role", role): backend for role, backend in policies.attention.per_role.items()
        }
        for where, backend in chosen.items():
            if backend not in PERTURBABLE_BACKENDS:
                yield ("policies", "attention", *where), (
                    f"backend {backend!r} bypasses the attention perturbation of the skip_layer term in "
                    f"recipe.phases.{perturbing[0]}.guidance; use an sdpa backend"
                )
    known = set(spec.model.components) | set(ROLES)
    for key in policies.quantization:
        if key not in known:
            yield ("policies", "quantization", key), "names neither a component nor a role"
        elif key in WEIGHTLESS_ROLES or (
            key in spec.model.components and spec.model.components[key].role in WEIGHTLESS_ROLES
        ):
            yield ("policies", "quantization", key), "tokenizers and schedulers hold no weights to quantize"
    for name, component in spec.model.components.items():
        if (component.file or "").lower().endswith(".gguf"):
            for key in (name, component.role):
                if key in policies.quantization:
                    yield ("policies", "quantization", key), (
                        f"component {name!r} comes from a GGUF file, whose weights are already quantized (they stay "
                        "packed and dequantize in each forward): remove this entry")


def _sparse_problems(spec: PipelineSpec, perturbing: list[int]):
    """Where sparse video attention cannot run: it restricts the attention that guidance perturbs on its scores, the
    tokens sequence parallelism splits, and a whole compiled denoiser call would build each call's layout inside the
    compiled code (regional compile traces the layout's redirect into the blocks, which compile once for dense steps
    and once for sparse ones)."""
    where = ("policies", "attention", "sparse")
    policies = spec.policies
    if perturbing:
        yield where, (f"the skip_layer term of recipe.phases.{perturbing[0]}.guidance perturbs attention scores, which "
                      "a sparse mask would change under it; drop one of them")
    if policies.parallel.sequence > 1:
        yield where, ("sequence parallelism (policies.parallel.ulysses, ring) splits the video's tokens over the "
                      "ranks, and the sparse mask is laid over the whole grid; use cfg or data parallelism")
    if policies.compile.mode == "full":
        yield where, ("policies.compile.mode 'full' compiles the denoiser's whole call, where sparse attention reads "
                      "each call's token grid and builds its layout (a block mask) outside the compiled code; use "
                      "compile mode regional, which compiles the blocks and traces the layout into them")


def _denoiser_quantized(spec: PipelineSpec) -> str | None:
    """Where the spec makes a denoiser quantized (a quantization policy, or a GGUF file), or None."""
    for key in spec.policies.quantization:
        if key == "denoiser" or (key in spec.model.components and spec.model.components[key].role == "denoiser"):
            return f"policies.quantization.{key}"
    for name, component in spec.model.components.items():
        if component.role == "denoiser" and (component.file or "").lower().endswith(".gguf"):
            return f"model.components.{name}.file, a GGUF file"
    return None


def _scale_out_problems(spec: PipelineSpec):  # noqa: C901 - one flat list of rules reads best
    """The rules of tensor, shard, vae_patch, distributed offload and VAE tiling, with their reasons (the
    families' own limits are the axes' refusals, checked when the family is known)."""
    p = spec.policies
    par, offload = p.parallel, p.offload
    distributed = getattr(offload, "distributed", False)
    quantized = _denoiser_quantized(spec)
    denoisers = {n for n, c in spec.model.components.items() if c.role == "denoiser"}
    adapted = sorted(slot for slot, a in spec.model.adapters.items() if a.target is None or a.target in denoisers)
    if par.tensor > 1:
        where = ("policies", "parallel", "tensor")
        if offload.strategy != "none":
            yield where, (f"tensor parallel keeps each rank's slice of the denoiser's linears on its device; "
                          f"{offload.strategy} offload moves whole modules (policies.offload.strategy: none)")
        if quantized:
            yield where, (f"tensor parallel splits plain linears into DTensor shards; the quantized denoiser "
                          f"({quantized}) holds quantized tensors it cannot split")
        if adapted:
            yield where, (f"tensor parallel splits nn.Linear layers, and the LoRA slot {adapted[0]!r} "
                          "(model.adapters) wraps them in peft layers it cannot split")
        if par.shard > 1:
            yield where, "tensor and shard together (2-D FSDP x TP) are not supported: use one of them"
    if par.shard > 1:
        where = ("policies", "parallel", "shard")
        if quantized:
            yield where, (f"sharding splits the denoiser's parameters over ranks; the quantized denoiser "
                          f"({quantized}) holds quantized tensors FSDP2 does not shard here")
        if offload.strategy == "model" or (offload.strategy in ("layerwise", "group") and not distributed):
            yield ("policies", "offload", "strategy"), (
                f"with shard, the denoiser's weights are already spread over the ranks; {offload.strategy} offload "
                "would move them again: use strategy none, or layerwise/group with distributed: true (each host "
                "keeps its shard)")
    if distributed and par.shard == 1:
        yield ("policies", "offload", "distributed"), (
            "distributed offload spreads the host copy over the shard ranks, which all-gather each block as it "
            "runs: set policies.parallel.shard to the number of ranks (2 or more)")
    if (par.tensor > 1 or par.shard > 1) and p.compile.mode == "full":
        yield ("policies", "compile", "mode"), (
            "tensor and shard put collectives at block boundaries; compile the blocks (mode regional), not the "
            "whole model")
    if par.vae_patch > 1:
        where = ("policies", "parallel", "vae_patch")
        if p.vae.tiling is False:
            yield where, ("vae_patch decodes the tiles of diffusers' tiled decode on different ranks: set "
                          "policies.vae.tiling (true, or {tile, overlap})")
        if par.in_step % par.vae_patch:
            yield where, (f"vae_patch {par.vae_patch} must divide the ranks that hold the same latents, "
                          f"cfg x tensor x ring x ulysses = {par.in_step} (it adds no processes of its own)")
