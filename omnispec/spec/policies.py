"""How a run uses the hardware: attention, MLP, offload, quantization, cache, compile, parallel.

Each section is validated here against the others (``pipeline.py``); the runtime applies them in one
place and one order: quantization at load, dtype/device, attention, MLP, cache, offload, compile.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from .base import SpecModel
from .kinds import Axes, Kinds

AttentionBackend = Literal[
    "auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "xformers", "sage", "int8_fp8",
    "flash4"
]
# Backends that run through torch's scaled_dot_product_attention, which diffusers' attention-score
# perturbation (skip-layer guidance with skip: attention_scores) and the sequence-parallel attention intercept;
# the others (xformers, sage, int8_fp8, flash4) bypass it.
PERTURBABLE_BACKENDS = ("auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
# Replacement kernels compiled code can call (operators): under compile one of them, named for every role, runs
# through one redirect around the denoiser's call that the compiler traces into each block.
COMPILED_REPLACEMENTS = ("flash4", "sage", "int8_fp8")


class SparseAttention(SpecModel):
    """Approximate: the video's self-attention restricted to nearby tokens of the (frames, height, width) grid, in
    tiles of ``tile`` tokens. ``sliding_tile``: a query tile sees the key tiles at most ``window`` tiles away along
    each axis. ``radial``: a query tile sees every tile of the frames at most ``window[0]`` tiles away in time; farther
    away, a spatial reach that halves each time the temporal distance doubles, never under ``window[1:]`` tiles. The
    first ``dense_fraction`` of each phase's steps run dense, where the layout of the video forms."""

    kind: Literal["sliding_tile", "radial"]
    tile: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(default=(2, 4, 4), description=(
        "Tokens per tile along (frames, height, width) of the denoiser's token grid."))
    window: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt] = Field(default=(1, 2, 2), description=(
        "Tiles each side a query tile sees along (frames, height, width) (radial: the frames seen whole, then the "
        "least spatial reach)."))
    dense_fraction: float = Field(default=0.25, ge=0, le=1, description=(
        "The first fraction of each phase's steps that runs dense attention."))


class AttentionPolicy(SpecModel):
    default: AttentionBackend = "auto"
    per_role: dict[str, AttentionBackend] = Field(
        default_factory=dict, description="Attention role (self, cross, joint, family roles) -> backend."
    )
    allow_fallback: bool = Field(default=False, description="Fall back to sdpa when a named backend can't run.")
    approximate: bool = Field(default=False, description="Let auto consider approximate kernels (sage, int8_fp8).")
    fused_qk_norm_rope: bool = Field(default=False, description=(
        "Prepare each attention's queries and keys (per-head RMS norms, the text stream's first, the RoPE) in one "
        "kernel for both instead of the model's separate operations (families that have it: FLUX; a Triton "
        "kernel on CUDA, the model's own operations elsewhere)."))
    sparse: SparseAttention | None = Field(default=None, description=(
        "Approximate, opt-in: sparse self-attention over the video's tokens (families with video-only "
        "self-attention: Wan, LTX-2), on FlexAttention block masks; None: dense."))


class MlpPolicy(SpecModel):
    fused_gelu: bool = Field(default=False, description=(
        "Apply each tanh-GELU feed-forward projection's bias and GELU in its matmul (cuBLASLt's epilogue) instead of "
        "a pass of their own, and let a family's parallel block (FLUX's single blocks) project its attention and MLP "
        "outputs back without concatenating them. CUDA; the model's own operations elsewhere. Rounds once where the "
        "model rounds twice: outputs differ from the model's by about one bfloat16 step."))
    precomputed_modulation: bool = Field(default=False, description=(
        "Compute the denoiser's modulation linears (AdaLN's shift, scale and gate, which read only the timestep and "
        "pooled-prompt embedding) for every step and sample of a request in one matmul each when its first step "
        "runs, and look each step's rows up after, instead of a matrix-vector product per block and step that reads "
        "the whole weight (what that reads and saves: BENCHMARKS.md, \"Modulation table\"). Families that have it: "
        "FLUX, Qwen-Image. Costs the table's memory, every modulation output for each step and distinct prompt; "
        "outputs differ from the model's by the rounding of a larger matmul."))


class OffloadSpec(SpecModel):
    """Base of the offload strategies (``OFFLOADS``). ``streams_blocks``: the denoiser's blocks are onloaded by
    hooks the compiler must not trace (a full-graph compile cannot contain them)."""

    streams_blocks: ClassVar[bool] = False


class NoOffload(OffloadSpec):
    strategy: Literal["none"]


class ModelOffload(OffloadSpec):
    """Only the running role-group (encoders, then denoisers, then the VAE) sits on the device."""

    strategy: Literal["model"]
    pin_memory: bool = Field(default=True, description=(
        "Keep one page-locked host copy of every weight, so moves neither allocate host memory nor block; "
        "false moves with Module.to as diffusers' enable_model_cpu_offload does (less pinned host memory)."))


class LayerwiseOffload(OffloadSpec):
    """Denoiser blocks stream host->device one at a time, prefetched on a side stream."""

    streams_blocks: ClassVar[bool] = True
    strategy: Literal["layerwise"]
    prefetch: bool = True
    pin_memory: bool = True
    distributed: bool = Field(default=False, description=(
        "Spread the host copy over the shard ranks (policies.parallel.shard): each host keeps 1/N of every block "
        "and the ranks all-gather a block as it runs (FSDP2 with CPU offload)."))


class GroupOffload(OffloadSpec):
    streams_blocks: ClassVar[bool] = True
    strategy: Literal["group"]
    blocks_per_group: PositiveInt = 1
    prefetch: bool = True
    pin_memory: bool = True
    distributed: bool = Field(default=False, description=(
        "As for layerwise: each group of blocks sharded over the shard ranks' hosts and all-gathered as it runs."))


# Each strategy's implementation lives with the policies (policies/offload/), named here so the spec layer never
# imports it.
OFFLOADS = Kinds("offload strategy", tag="strategy")
OFFLOADS.register(NoOffload, "omnispec.policies.offload:NONE")
OFFLOADS.register(ModelOffload, "omnispec.policies.offload:MODEL")
OFFLOADS.register(LayerwiseOffload, "omnispec.policies.offload:BLOCKS")
OFFLOADS.register(GroupOffload, "omnispec.policies.offload:BLOCKS")

QuantMethod = Literal[
    "fp8_dynamic", "fp8_weight_only", "int8_weight_only", "int8_dynamic", "int4_weight_only", "nf4", "int8"
]
TORCHAO_METHODS = ("fp8_dynamic", "fp8_weight_only", "int8_weight_only", "int8_dynamic", "int4_weight_only")
CUDA_ONLY_METHODS = ("fp8_dynamic", "fp8_weight_only", "int4_weight_only", "nf4", "int8")


class Quantization(SpecModel):
    method: QuantMethod
    exclude: list[str] = Field(default_factory=list, description=(
        "Modules left unquantized: an entry matches a module whose dotted name contains it followed by a dot, "
        "as diffusers and transformers match modules_to_not_convert."))
    granularity: Literal["tensor", "row"] | None = Field(default=None, description=(
        "fp8_dynamic scale granularity (torchao PerTensor / PerRow); default: torchao's."))

    @model_validator(mode="after")
    def _granularity_is_fp8_dynamic(self) -> Quantization:
        if self.granularity is not None and self.method != "fp8_dynamic":
            raise ValueError(f"granularity applies to fp8_dynamic only, not {self.method}")
        return self


class CacheSpec(SpecModel):
    """Base of the step caches (``CACHES``). ``hooked``: diffusers hooks on the denoiser's blocks decide per step
    from state of their own, which a full-graph compile cannot trace and a replay of a stochastic step cannot
    rebuild; a cache without hooks is read by the denoise loop."""

    hooked: ClassVar[bool] = False


class NoCache(CacheSpec):
    kind: Literal["none"]


class FirstBlockCache(CacheSpec):
    """Reuse the rest of the network when the first block's output changed less than ``threshold``."""

    hooked: ClassVar[bool] = True
    kind: Literal["first_block"]
    threshold: float = Field(default=0.05, gt=0)


class TaylorSeerCache(CacheSpec):
    hooked: ClassVar[bool] = True
    kind: Literal["taylorseer"]
    interval: PositiveInt = 2
    max_order: PositiveInt = 1
    warmup_steps: int = Field(default=3, ge=0)


class MagCache(CacheSpec):
    """MagCache skips steps by the accumulated residual-magnitude ratio; ``mag_ratios`` (one per step)
    come from a calibration run (``calibrate: true`` runs without skipping and logs them)."""

    hooked: ClassVar[bool] = True
    kind: Literal["magcache"]
    threshold: float = Field(default=0.06, gt=0)
    max_skip_steps: PositiveInt = 3
    retention_ratio: float = Field(default=0.2, ge=0, le=1)
    mag_ratios: list[float] | None = None
    calibrate: bool = False

    @model_validator(mode="after")
    def _ratios_or_calibration(self) -> MagCache:
        if self.mag_ratios is None and not self.calibrate:
            raise ValueError("magcache needs mag_ratios from a calibration run, or calibrate: true to make them")
        return self


class StepMaskCache(CacheSpec):
    """A declared pattern: ``mask[i]`` true computes step ``i``, false reuses the last prediction."""

    kind: Literal["step_mask"]
    mask: list[bool] = Field(min_length=1)

    @field_validator("mask")
    @classmethod
    def _first_step_computes(cls, mask: list[bool]) -> list[bool]:
        if not mask[0]:
            raise ValueError("the first step must compute (nothing to reuse yet)")
        return mask


# Each cache's implementation lives with the policies (policies/caches/, one file per kind).
CACHES = Kinds("cache")
CACHES.register(NoCache, "omnispec.policies.caches.none:NONE")
CACHES.register(FirstBlockCache, "omnispec.policies.caches.first_block:FIRST_BLOCK")
CACHES.register(TaylorSeerCache, "omnispec.policies.caches.taylorseer:TAYLORSEER")
CACHES.register(MagCache, "omnispec.policies.caches.magcache:MAGCACHE")
CACHES.register(StepMaskCache, "omnispec.policies.caches.step_mask:STEP_MASK")


# Inductor's own bound on persistent reductions (torch 2.11 to 2.13), and omnispec's default past it (what it gives:
# BENCHMARKS.md, "Inductor options: eager rounding, fixed reductions, rows read once").
INDUCTOR_PERSISTENT_ROWS = 1024
DEFAULT_PERSISTENT_ROWS = 4096


class CompilePolicy(SpecModel):
    mode: Literal["none", "regional", "full"] = "none"
    backend: str = Field(default="inductor", pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$", description=(
        "torch.compile's backend by its registered name (torch.compiler.list_backends); checked against torch's "
        "registry before any weight loads."))
    dynamic: bool | None = Field(default=None, description=(
        "torch.compile's dynamic: null, torch's automatic dynamic shapes (a graph compiles for its first call's "
        "shapes; a size that then changes, such as a batch, token or frame count, makes the next graph symbolic in "
        "it, so a mix of request sizes keeps a bounded number of graphs per block); false: a graph per distinct "
        "shape, which a mix of more shapes than dynamo's recompile limit (raised to 64 per block) refuses under "
        "fullgraph; true: symbolic sizes from the first call."))
    fullgraph: bool = True
    cudagraphs: bool = Field(default=False, description=(
        "Record the compiled code's kernels as CUDA graphs on its first calls and replay them after (torch.compile's "
        "reduce-overhead mode): the host no longer launches each kernel. Regional: a graph per block; full: one graph "
        "per denoiser call, its output copied out. Inductor on CUDA (elsewhere it runs without graphs); a call of new "
        "shapes records another graph."))
    autotune: bool = Field(default=False, description=(
        "Time inductor's Triton matmul templates against cuBLAS for each matmul shape and keep the fastest "
        "(max-autotune): minutes more on the first compile, kept in inductor's cache after."))
    vae: bool = Field(default=False, description=(
        "Also compile each VAE's decoder whole (one graph per latent shape, graph breaks allowed, no CUDA graphs): "
        "inductor fuses its norms and activations and lays its convolutions out channels-last."))
    eager_rounding: bool = Field(default=True, description=(
        "Inductor keeps every bfloat16/float16 rounding eager would make inside its fused kernels (its "
        "emulate_precision_casts), so the inference graphs of a rollout and the training graphs of its replay with "
        "gradients compute the same numbers: the replay ratio stays exactly 1 under compile. Off, fused kernels keep "
        "intermediates in float32 where the training graph saves them rounded, and a replay with gradients moves its "
        "log-probs off its rollout's. Inductor only; other backends compute as they do."))
    fixed_reductions: bool | None = Field(default=None, description=(
        "Inductor picks each reduction kernel's launch configuration (block size, warps) by rule instead of timing "
        "the candidates at its first launch (its deterministic mode). The configuration sets the order a row's sum "
        "adds up in, and timing can pick differently for a rollout's inference kernel and its replay's training "
        "kernel, or in another process. Inductor only. Default: on, unless autotune (which times every choice, "
        "matmuls too, and which this mode would stop)."))
    persistent_rows: int | None = Field(default=None, ge=1024, le=16384, description=(
        "Reductions along a row of at most this many elements (a LayerNorm's or RMSNorm's row) keep the row in "
        "registers and read it once: inductor's persistent reductions, which its own rule stops at 1,024 elements. "
        "Past that a norm's kernel reads its row twice (sums, then output); FLUX's, SD3.5's, Wan's and "
        "Qwen-Image's rows have 1,536 to 5,120. Default: 4,096 when inductor compiles; 1,024 keeps inductor's own "
        "rule. A rule, not a timing: a rollout and its replay get the same kernels. Inductor's Triton kernels (CUDA) "
        "only."))

    @model_validator(mode="after")
    def _inductor_options(self) -> CompilePolicy:
        asked = [name for name in ("cudagraphs", "autotune", "vae", "persistent_rows")
                 if getattr(self, name)]
        if asked and self.mode == "none":
            raise ValueError(f"{' and '.join(asked)} apply to compiled code; set mode regional or full")
        modes = [name for name in asked if name != "vae"]
        if modes and self.backend != "inductor":
            raise ValueError(f"{' and '.join(modes)} {'is' if len(modes) == 1 else 'are'} inductor's; backend "
                             f"{self.backend!r} compiles without {'it' if len(modes) == 1 else 'them'}")
        if self.autotune and self.fixed_reductions:
            raise ValueError("autotune times the kernels' launch choices and fixed_reductions picks them by rule "
                             "(inductor's deterministic mode, which skips the matmul search too); set one of them")
        return self

    @property
    def reductions_fixed(self) -> bool:
        """Whether inductor picks reduction configurations by rule (``fixed_reductions``; by default, unless
        autotune)."""
        return self.fixed_reductions if self.fixed_reductions is not None else not self.autotune

    @property
    def rows_read_once(self) -> int | None:
        """The row length up to which inductor's norms read their rows once (``persistent_rows``, by default
        ``DEFAULT_PERSISTENT_ROWS`` under inductor); None where inductor's own rule stands (no compile, another
        backend, or 1,024 asked)."""
        if self.mode == "none" or self.backend != "inductor":
            return None
        rows = self.persistent_rows if self.persistent_rows is not None else DEFAULT_PERSISTENT_ROWS
        return rows if rows > INDUCTOR_PERSISTENT_ROWS else None

    @property
    def inductor_mode(self) -> str | None:
        """torch.compile's ``mode`` for these options (None: its default)."""
        if self.cudagraphs:
            return "max-autotune" if self.autotune else "reduce-overhead"
        return "max-autotune-no-cudagraphs" if self.autotune else None


class ParallelPolicy(SpecModel):
    """Degrees whose product (all but ``vae_patch``) is the world size the run requires; each axis's behaviour is
    the object ``PARALLEL_AXES`` names (``runtime/parallel/``, one file per axis). Fields are in mesh order,
    outermost first."""

    data: PositiveInt = Field(default=1, description=(
        "Groups a request's samples are split over; every rank gets the whole output."))
    shard: PositiveInt = Field(default=1, description=(
        "Ranks the denoisers' weights are sharded over (FSDP2 fully_shard per block, gathered block by block as "
        "they run); the ranks split a data group's samples between them, so with data > 1 this is HSDP."))
    cfg: PositiveInt = Field(default=1, description=(
        "Ranks a step's guidance passes are shared over, round-robin; the predictions are gathered on every rank."))
    tensor: PositiveInt = Field(default=1, description=(
        "Ranks each forward's linears are split over (the family's tensor-parallel plan on torch's DTensor): "
        "attention heads and feed-forward widths divide by it."))
    ring: PositiveInt = Field(default=1, description=(
        "Ranks each forward's sequence is split over by ring attention (diffusers' context parallelism)."))
    ulysses: PositiveInt = Field(default=1, description=(
        "Ranks each forward's sequence is split over by all-to-all attention (diffusers' context parallelism); "
        "the attention heads must divide by it."))
    vae_patch: PositiveInt = Field(default=1, description=(
        "Ranks the VAE decode's tiles are spread over (diffusers' tiled decode, each tile decoded on one rank and "
        "shared): taken from the ranks that end the loop with the same latents (cfg x tensor x ring x ulysses), "
        "so it adds no processes; needs policies.vae.tiling."))

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, name) for name in PARALLEL_AXES.mesh_names)

    @property
    def sequence(self) -> int:
        """Ranks one forward's sequence is split over (ring x ulysses)."""
        return self.ring * self.ulysses

    @property
    def in_step(self) -> int:
        """Ranks that run every forward of a sample together and end with the same latents."""
        return self.cfg * self.tensor * self.ring * self.ulysses


# Mesh order, outermost first: data groups, the shard ranks splitting a group's samples, cfg groups, then the ranks
# of one forward (tensor, then sequence). vae_patch works within a cfg x tensor x ring x ulysses group.
PARALLEL_AXES = Axes("parallel axis")
PARALLEL_AXES.register("data", "omnispec.runtime.parallel.data:DATA")
PARALLEL_AXES.register("shard", "omnispec.runtime.parallel.shard:SHARD")
PARALLEL_AXES.register("cfg", "omnispec.runtime.parallel.cfg:CFG")
PARALLEL_AXES.register("tensor", "omnispec.runtime.parallel.tensor:TENSOR")
PARALLEL_AXES.register("ring", "omnispec.runtime.parallel.sequence:SEQUENCE")
PARALLEL_AXES.register("ulysses", "omnispec.runtime.parallel.sequence:SEQUENCE")
PARALLEL_AXES.register("vae_patch", "omnispec.runtime.parallel.vae_patch:VAE_PATCH", mesh=False)


class VaeTiles(SpecModel):
    """Tile size and overlap in output pixels (each VAE's own tile attributes are set from them)."""

    tile: PositiveInt
    overlap: int = Field(ge=0)

    @model_validator(mode="after")
    def _overlap_inside(self) -> VaeTiles:
        if self.overlap >= self.tile:
            raise ValueError(f"overlap {self.overlap} must be smaller than tile {self.tile}")
        return self


class VaePolicy(SpecModel):
    """How the VAE decodes (diffusers' own switches on every VAE component that has them)."""

    tiling: bool | VaeTiles = Field(default=False, description=(
        "Decode in overlapping tiles (diffusers' enable_tiling): true takes each VAE's default tiles, {tile, "
        "overlap} sets them in pixels. Bounds the decode's memory; the blend makes the output differ slightly "
        "from an untiled decode."))
    slicing: bool = Field(default=False, description=(
        "Decode the samples of a batch one at a time (diffusers' enable_slicing)."))


class KernelPolicySpec(SpecModel):
    """Base of a kernel policy a plugin registers (``KERNEL_POLICIES``, tag ``kind``): a technique put on the loaded
    denoisers, with the target it reads from a family (``omnispec.targets``)."""


# Kernel policies beyond the built-in sections, registered with the object implementing them (a plugin's, a test's):
# it refuses what a family's targets cannot take before loading, and applies itself to the loaded denoisers.
KERNEL_POLICIES = Kinds("kernel policy")


PresetName = Literal["none", "fast", "fastest"]


class Policies(SpecModel):
    preset: PresetName = Field(default="none", description=(
        "A named bundle of speed-ups, each applied where the family and device support it: fast (every exact one: "
        "regional compile with CUDA graphs, fused kernels, the fastest exact attention installed) or fastest (fast "
        "plus the approximate ones: fp8 matmuls). Fields the spec sets itself keep their values."))
    attention: AttentionPolicy = Field(default_factory=AttentionPolicy)
    mlp: MlpPolicy = Field(default_factory=MlpPolicy)
    offload: Annotated[OffloadSpec, OFFLOADS] = Field(default_factory=lambda: NoOffload(strategy="none"))
    quantization: dict[str, Quantization] = Field(
        default_factory=dict, description="Component name or role -> quantization."
    )
    cache: Annotated[CacheSpec, CACHES] = Field(default_factory=lambda: NoCache(kind="none"))
    compile: CompilePolicy = Field(default_factory=CompilePolicy)
    parallel: ParallelPolicy = Field(default_factory=ParallelPolicy)
    vae: VaePolicy = Field(default_factory=VaePolicy)
    kernels: list[Annotated[KernelPolicySpec, KERNEL_POLICIES]] = Field(default_factory=list, description=(
        "Kernel policies registered beyond the built-in sections (each by its kind), applied after them in order."))

    def quantization_key(self, name: str, role: str) -> str | None:
        """The ``quantization`` entry that applies to component ``name`` of ``role``: its name's, else its role's."""
        return next((key for key in (name, role) if key in self.quantization), None)


CACHES.held_by(Policies)
KERNEL_POLICIES.held_by(Policies)
OFFLOADS.held_by(Policies)
