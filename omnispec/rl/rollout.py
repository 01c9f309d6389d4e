"""Rollouts with per-step log-probs, and their replay with gradients, through the runtime's one ``Run``.

A rollout is a ``Run`` whose walks take a stochastic stepper on the window's steps, observed step by step;
replay builds a ``Run`` for the same request and calls its step body (``Run.prediction``) and the same
stepper's ``score`` on stored states. Nothing of the loop is repeated here, so with unchanged weights
``exp(new - old) == 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import BaseModel, TypeAdapter, ValidationError
from torch.utils.checkpoint import checkpoint

from ..runtime.families import Conditioning, Streams
from ..runtime.families.latents import to_host
from ..runtime.phases import set_adapter
from ..runtime.plan import Walk
from ..runtime.run import Run
from ..runtime.samplers import StepResult
from ..spec import SpecError, SpecTypeError
from ..spec.errors import Problem, from_validation_error
from ..spec.recipe import SAMPLERS, Sampler, stochastic_kinds
from ..spec.request import Request
from .checks import check_pipeline, check_replay_args, check_rollout_args, check_rollout_fits, shape_of
from .replay_groups import Group, affordable, as_rolled_out, groups, reproduces
from .replay_memory import Batching, ReplayBatcher, blocks_checkpointed

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline

_SAMPLER = TypeAdapter(Sampler)


@dataclass
class Rollout:
    """One rollout batch: B = prompts x group_size samples, W stochastic steps each (consecutive, in one walk)."""

    prompts: list[str]
    group_ids: torch.Tensor  # (B,)
    seeds: list[int]  # (B,) initial-noise seeds; SDE noise uses seed + SDE_SEED_OFFSET
    # per stream (B, W + 1, ...) float32: the window's first input, then what each stochastic step drew (before the
    # family's reimpose, which replay applies again)
    states: dict[str, torch.Tensor]
    log_probs: torch.Tensor  # (B, W) float32, summed over streams
    stream_log_probs: dict[str, torch.Tensor]  # per stream (B, W)
    sigmas: torch.Tensor  # (B, W)
    timesteps: torch.Tensor  # (B, W)
    step_indices: torch.Tensor  # (B, W) long: which step of the request (counted over all walks) each is
    positive: Conditioning
    negative: Conditioning | None
    array: np.ndarray  # decoded outputs, (B, H, W, C) or (B, F, H, W, C)
    request: Request
    sampler: Any
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)
    # the trainer's version of the weights it ran at, when a ``RolloutEngine`` made it (None otherwise): the number
    # its last weight update carried, 0 before any
    policy_version: int | None = None
    # (B,) long: how many samples the forwards that stepped each sample ran (its request's batch), which an exact
    # replay reproduces (``replay_groups``); None where not recorded
    forward_batch: torch.Tensor | None = None

    @property
    def window(self) -> int:
        return self.log_probs.shape[1]

    @property
    def latents(self) -> torch.Tensor:
        """The states of a single-stream family (``states["latents"]``)."""
        if len(self.states) != 1:
            raise AttributeError(f"this rollout has streams {list(self.states)}; use .states[name]")
        return next(iter(self.states.values()))

    def select(self, rows: Sequence[int] | torch.Tensor) -> Rollout:
        """The rollout restricted to some samples (for micro-batched or split policy updates)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = index.tolist()
        return Rollout(
            prompts=[self.prompts[i] for i in pick], group_ids=self.group_ids[index], seeds=[self.seeds[i] for i in pick],
            states={s: v[index] for s, v in self.states.items()}, log_probs=self.log_probs[index],
            stream_log_probs={s: v[index] for s, v in self.stream_log_probs.items()}, sigmas=self.sigmas[index],
            timesteps=self.timesteps[index], step_indices=self.step_indices[index],
            positive=self.positive.rows(index), negative=self.negative.rows(index) if self.negative is not None else None,
            array=self.array[pick],
            request=self.request.model_copy(update={"prompts": [self.prompts[i] for i in pick],
                                                    "seeds": [self.seeds[i] for i in pick]}),
            sampler=self.sampler, weight_version=self.weight_version, extra=dict(self.extra),
            policy_version=self.policy_version,
            forward_batch=self.forward_batch[index] if self.forward_batch is not None else None,
        )


@dataclass
class Replay:
    """Replayed transitions ``states[:, k] -> states[:, k + 1]`` for the K requested window positions, on the
    pipeline's device, float32. Per-stream values are dicts keyed by stream name."""

    log_probs: torch.Tensor  # (B, K): the streams' log-probs summed (each averaged over its elements)
    stream_log_probs: dict[str, torch.Tensor]  # (B, K) per stream
    transition_means: dict[str, torch.Tensor]  # (B, K, ...) per stream: the mean of each transition
    transition_stds: dict[str, torch.Tensor]  # (B, K) per stream: the std of each transition
    # (B, K) per stream: Flow-GRPO's std_dev_t, what its KL divides by: the noise scale before the
    # sqrt(sigma - sigma_next) factor (sde: noise_level sqrt(sigma / (1 - sigma)); dance_sde: eta); for cps the
    # transition std itself
    std_t: dict[str, torch.Tensor]
    # how the forwards ran (``replay_memory``): micro-batch size, graphs kept or recomputed in the backward, and why
    batching: Batching | None = None

    def select(self, rows: Sequence[int] | torch.Tensor | None = None,
               steps: Sequence[int] | None = None) -> Replay:
        """The replay restricted to some samples and replayed positions (``None``: all), to pair a whole-batch
        replay with a later one of ``Rollout.select(rows)`` and ``steps`` (``omnispec.rl.guard_log_ratio``)."""
        r = slice(None) if rows is None else torch.as_tensor(rows, dtype=torch.long).to(self.log_probs.device)
        k = slice(None) if steps is None else torch.as_tensor(list(steps), dtype=torch.long).to(self.log_probs.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[r][:, k]

        return Replay(pick(self.log_probs), {s: pick(v) for s, v in self.stream_log_probs.items()},
                      {s: pick(v) for s, v in self.transition_means.items()},
                      {s: pick(v) for s, v in self.transition_stds.items()},
                      {s: pick(v) for s, v in self.std_t.items()}, batching=self.batching)


def check_replay_pair(first: tuple[str, Any], second: tuple[str, Any]) -> None:
    """Two arguments (name, value) that must be replays of the same streams, as losses comparing them need."""
    for name, value in (first, second):
        if not isinstance(value, Replay):
            raise SpecTypeError.single(f"expected an omnispec.rl.Replay (what Pipeline.log_prob returns), got "
                                       f"{type(value).__name__}", name)
    if set(first[1].transition_means) != set(second[1].transition_means):
        raise SpecError.single(f"streams {sorted(second[1].transition_means)} differ from the {first[0]} replay's "
                               f"{sorted(first[1].transition_means)}", second[0])


def kl(policy: Replay, reference: Replay, *, normalize: bool = True) -> torch.Tensor:
    """Flow-GRPO's KL term per sample and replayed step, ``(B, K)``: for each stream the mean over its elements
    of ``(mean - mean_ref)^2``, divided by ``2 std_t^2`` (the policy's ``std_t``, without the ``sqrt(-dt)``
    factor, as Flow-GRPO's trainer divides), summed over streams. ``kl(new, ref).mean()`` over one replayed
    step is Flow-GRPO's ``kl_loss`` for it. ``normalize=False`` leaves out the division (Flow-CPS's trainer).

    ``policy`` is a replay with the trained weights (``pipe.log_prob(ro, grad=True)``), ``reference`` the same
    transitions under the reference weights (inside ``omnispec.rl.reference(pipe)``)."""
    check_replay_pair(("policy", policy), ("reference", reference))
    total = None
    for s, mean in policy.transition_means.items():
        ref = reference.transition_means[s]
        if ref.shape != mean.shape:
            raise SpecError.single(f"stream {s!r}: means of shape {tuple(ref.shape)}, the policy's are "
                                   f"{tuple(mean.shape)}", "reference")
        per_step = ((mean - ref.to(mean.device)) ** 2).mean(dim=tuple(range(2, mean.ndim)))
        if normalize:
            per_step = per_step / (2 * policy.std_t[s] ** 2)
        total = per_step if total is None else total + per_step
    assert total is not None
    return total


# ---- argument checks ------------------------------------------------------------------------------------

def resolve_sampler(pipe: Pipeline, sampler: Any | None) -> Any:
    """The sampler a rollout uses: the first phase's (None), a dict validated as a sampler spec, or a sampler
    model; a rollout needs a stochastic one (``sde``, ``cps``, ``dance_sde``)."""
    if sampler is None:
        sampler = pipe.spec.recipe.phases[0].sampler
    elif isinstance(sampler, Mapping):
        try:
            sampler = _SAMPLER.validate_python(dict(sampler))
        except ValidationError as exc:
            found = from_validation_error(exc, dict(sampler)).problems
            raise SpecError([Problem(f"sampler.{p.path}" if p.path else "sampler", p.message) for p in found]) from None
    elif not isinstance(sampler, BaseModel) or getattr(sampler, "kind", None) not in SAMPLERS.kinds:
        raise SpecTypeError.single(f"expected a sampler spec (a dict such as {{'kind': 'sde'}}) or None, got "
                                   f"{type(sampler).__name__}", "sampler")
    if not sampler.stochastic:
        raise SpecError.single(f"rollouts need a stochastic sampler (one of {stochastic_kinds()}), got "
                               f"{sampler.kind!r}; set recipe.phases.0.sampler or pass sampler=", "sampler")
    return sampler


# ---- rollout --------------------------------------------------------------------------------------------

def rollout(
    pipe: Pipeline,
    prompts: str | Sequence[str],
    group_size: int = 1,
    seed: int = 0,
    sampler: Any | None = None,
    shared_noise: bool = False,
    sample_offset: int = 0,
    **request: Any,
) -> Rollout:
    """Roll out ``prompts x group_size`` samples with a stochastic sampler and record its window.

    Sample ``b`` (counting from ``sample_offset``, the position of this batch in a larger sharded one) starts
    from seed ``seed + b`` (``seed + group`` with ``shared_noise``) and draws its SDE noise on the pipeline's
    device from seed ``seed + b + 2**31``. The window counts steps over the whole request and must lie within
    one walk; by default it leaves out the walk's last step (``include_last``). States are stored in float32
    whatever the model's dtype, and each log-prob scores exactly the stored sample.

    Arguments are checked before any forward: ``prompts`` a string or a non-empty sequence of strings,
    ``group_size`` an int >= 1, ``seed`` an int (every SDE seed within torch's range), ``sampler`` None (the
    first phase's), a dict validated as a sampler spec, or a sampler model, and stochastic; ``shared_noise`` a
    bool; ``sample_offset`` a multiple of ``group_size`` >= 0. A wrong type raises ``SpecTypeError`` (a
    ``TypeError``), a wrong value ``SpecError`` (a ``ValueError``), each naming the argument; ``request``
    fields are checked as ``Pipeline.request`` checks them.
    """
    prompts = check_rollout_args(prompts, group_size, seed, shared_noise, sample_offset)
    sampler = resolve_sampler(pipe, sampler)
    check_pipeline(pipe)
    expanded = [p for p in prompts for _ in range(group_size)]
    first_group = sample_offset // group_size
    group_ids = torch.arange(first_group, first_group + len(prompts)).repeat_interleave(group_size)
    seeds = [seed + (int(g) if shared_noise else sample_offset + b) for b, g in enumerate(group_ids)]
    req = pipe.request(expanded, seeds, **request)
    ids = torch.arange(sample_offset, sample_offset + len(expanded)) if sampler.window.kind == "random" and \
        sampler.window.scope == "sample" else group_ids
    plan = pipe.plan(req, rollout={"sampler": sampler, "ids": ids, "seed": seed,
                                   "noise_seeds": [seed + sample_offset + b for b in range(len(expanded))]})
    assert plan.stochastic is not None
    walk, local = plan.stochastic.walk, plan.stochastic.local_mask()
    if pipe.policies.steps:
        reused = [i for i in torch.nonzero(local.any(0)).flatten().tolist() if not pipe.policies.steps.computes(i)]
        if reused:
            raise SpecError.single(f"policies.cache.mask reuses stochastic step(s) {reused}; replay computes every "
                                   "step it scores, so the window's steps must compute", "policies.cache.mask")
    run = Run(pipe, plan, trains=True)  # the kernels its replays with gradients will run
    states: list[tuple[int, Streams, Streams, StepResult]] = []
    clean: dict[str, Streams] = {}

    def observe(w: Walk, i: int, x_in: Streams, result: StepResult) -> None:
        if w is walk and bool(local[:, i].any()):
            states.append((i, {s: v.detach().float() for s, v in x_in.items()},
                           {s: v.detach().float() for s, v in result.next.items()}, result))
        if w is walk and result.x0 is not None:
            clean["x0"] = result.x0

    with torch.no_grad():
        results = run.execute(observe)
        out = results[pipe.spec.recipe.output_index() or 0]
        latents = out.latents
        output_phase = pipe.spec.recipe.phases[pipe.spec.recipe.output_index() or 0].name
        if "x0" in clean and any(r.phase.name == output_phase for r in walk.phases):
            latents = pipe.family.reimpose(clean["x0"], walk.images, walk.geometry, 0.0)  # DanceGRPO: decode x0
        decoded = pipe.decode(latents, out.geometry)
    return _record(run, walk, local, states, prompts=expanded, group_ids=group_ids - first_group, seeds=seeds,
                   array=decoded.array, sampler=sampler, weight_version=pipe.weight_version,
                   forward_batch=torch.full((len(expanded),), len(expanded), dtype=torch.long))


def _record(run: Run, walk: Walk, mask: torch.Tensor, states: list[tuple[int, Streams, Streams, StepResult]],
            **fields: Any) -> Rollout:
    """Gather the observed steps into (B, W + 1, ...) states on the device, copied to the host once: the window's
    first state, then what each step drew. A family's ``reimpose`` (the kept region of inpainting) turns a drawn
    state into the next step's input; replay applies it again to a stored state, so each transition is scored
    against the state the sampler drew, as the rollout scored it."""
    w = int(mask[0].sum())
    if bool((mask.sum(1) != w).any()):
        raise SpecError.single("every sample's window must have the same length", "sampler.window")
    b = mask.shape[0]
    first_in = states[0][1]
    dev = next(iter(first_in.values())).device
    stored = {s: torch.empty((b, w + 1, *v.shape[1:]), dtype=torch.float32, device=dev) for s, v in first_in.items()}
    per_stream = {s: torch.empty((b, w), dtype=torch.float32, device=dev) for s in first_in}
    idx = torch.empty((b, w), dtype=torch.long)
    position = mask.long().cumsum(1) - 1
    for i, x_in, x_out, result in states:
        rows = torch.nonzero(mask[:, i]).flatten()
        k = position[rows, i]
        rows_d, k_d = rows.to(dev), k.to(dev)
        first = rows_d[k_d == 0]
        for s in stored:
            stored[s][first, 0] = x_in[s][first]
            stored[s][rows_d, k_d + 1] = x_out[s][rows_d]
            per_stream[s][rows_d, k_d] = result.stream_log_probs[s][rows_d]  # type: ignore[index]
        idx[rows, k] = i
    sigmas = walk.steps.sigmas.cpu()
    return Rollout(
        states={s: to_host(v) for s, v in stored.items()}, log_probs=sum(per_stream.values()).cpu(),  # type: ignore[union-attr]
        stream_log_probs={s: v.cpu() for s, v in per_stream.items()}, sigmas=sigmas[idx],
        timesteps=walk.steps.timesteps.cpu().to(torch.float32)[idx], step_indices=idx + walk.offset,
        positive=run.positive, negative=run.negative, request=run.request, **fields,
    )


# ---- replay ---------------------------------------------------------------------------------------------

def log_prob(
    pipe: Pipeline,
    ro: Rollout,
    steps: Sequence[int] | None = None,
    grad: bool = True,
    micro_batch: int | None = None,
    exact: bool = True,
) -> Replay:
    """Recompute the log-prob of each stored transition ``states[:, k] -> states[:, k + 1]``.

    ``steps`` are positions in the window (default: all). Samples are replayed grouped by the step they
    were at, ``micro_batch`` samples per forward, through the same step body and stepper as the rollout; a
    step of a multi-phase walk (Wan2.2's two experts) runs through the phase, denoiser and adapter that made it.
    With gradients and ``micro_batch=None`` on a GPU, the micro-batch follows the device's free memory: the first
    forward (one sample) is measured, and the rest keep their graphs for the trainer's backward where they fit, or
    are recomputed inside it where they don't (``replay_memory``; ``Replay.batching`` says which and why).

    ``exact`` (the default) values a replay whose forwards see other row counts than the rollout's (micro-batches, a
    ``select``) by forwards without gradients of the rollout's size (``replay_groups``: a kernel's summation order
    follows the row count), the gradients coming from the replay's own forwards. With gradients through a compiled
    denoiser it also takes each prediction's values from a forward without gradients, the inference graphs the
    rollout ran, and its gradients from the forward with them:
    the training graphs fuse other kernels (AOTAutograd partitions them out of a joint graph that also saves for the
    backward), and a reduction fused with other neighbours adds a row up in another order, so their values can
    differ in the last bits (BENCHMARKS.md, "Replay exactness"). Either costs one more forward without gradients
    (per step at the rollout's size, or per micro-batch); ``exact=False`` skips it and reads the replay's own
    forwards' values. A whole rollout replayed without gradients runs its own forwards alone, exactly.

    Before any forward, ``ro`` must be a ``Rollout`` that fits this pipeline: its batch (prompts, group ids,
    seeds, encodings, log-probs), stream names and shapes ``(B, W + 1, ...)`` for the request's geometry,
    float32 states, consecutive step indices within one walk of this pipeline's plan for the request, and the
    sigmas this pipeline steps there; ``steps`` a sequence of positions in ``[0, W)``, ``grad`` a bool,
    ``micro_batch`` None or an int >= 1. A wrong type raises ``SpecTypeError`` (a ``TypeError``), a misfit
    ``SpecError`` (a ``ValueError``), each naming the argument or field.
    """
    if not isinstance(ro, Rollout):
        raise SpecTypeError.single(f"expected an omnispec.rl.Rollout (what Pipeline.rollout returns), got "
                                   f"{type(ro).__name__}", "rollout")
    if not isinstance(ro.log_probs, torch.Tensor) or ro.log_probs.ndim != 2:
        raise SpecError.single(f"expected shape (B, W), got {shape_of(ro.log_probs)}", "rollout.log_probs")
    ks = check_replay_args(steps, grad, micro_batch, exact, ro.window)
    if not isinstance(ro.sampler, BaseModel):
        raise SpecTypeError.single(f"expected the sampler spec the rollout ran, got {type(ro.sampler).__name__}",
                                   "rollout.sampler")
    sampler = resolve_sampler(pipe, ro.sampler)
    check_pipeline(pipe)
    if not isinstance(ro.request, Request):
        raise SpecTypeError.single(f"expected the Request the rollout ran, got {type(ro.request).__name__}",
                                   "rollout.request")
    run = Run(pipe, pipe.plan(ro.request), encodings=(ro.positive, ro.negative), trains=True)
    check_rollout_fits(pipe, ro, run)
    b = len(ro.prompts)
    streams = list(ro.states)
    dev = pipe.device
    out_lp = {s: torch.empty((b, len(ks)), dtype=torch.float32, device=dev) for s in streams}
    out_std = {s: torch.empty((b, len(ks)), dtype=torch.float32, device=dev) for s in streams}
    out_std_t = {s: torch.empty((b, len(ks)), dtype=torch.float32, device=dev) for s in streams}
    means: dict[str, list[list[torch.Tensor | None]]] = {s: [[None] * len(ks) for _ in range(b)] for s in streams}
    sigmas: dict[int, list[float]] = {}  # per walk (by id), its sigmas: each stored state's noise level
    context = torch.enable_grad() if grad else torch.no_grad()
    two_forwards = grad and exact and pipe.spec.policies.compile.mode != "none"
    batcher = ReplayBatcher(dev, grad, micro_batch, b * len(ks))
    scored = groups(ro.step_indices, ro.forward_batch, ks)

    def enter(group: Group) -> tuple[Walk, int]:
        """The walk of the group's step, conditioned once, with the adapter of the step's phase."""
        walk = run.plan.walk_of(group.step)
        i = group.step - walk.offset
        if id(walk) not in sigmas:
            run.condition(walk)
            sigmas[id(walk)] = walk.steps.sigmas.tolist()
        set_adapter(run.spec, walk.owner(i).phase, run.components, pipe.adapters)
        return walk, i

    def inputs(walk: Walk, i: int, k: int, sel: list[int]) -> Streams:
        index = torch.tensor(sel)
        images = walk.images.rows(index) if walk.images is not None else None
        return pipe.family.reimpose({s: ro.states[s][index, k].to(dev) for s in streams}, images, walk.geometry,
                                    sigmas[id(walk)][i])

    with context:
        if batcher.probing and scored:  # what one sample's graph keeps, counted before any graph is kept
            walk, i = enter(scored[0])
            one = scored[0].rows[:1]
            batcher.probe(lambda: _prediction(run, walk, i, inputs(walk, i, scored[0].k, one), one, None, False),
                          run.components.values(), walk.owner(i).denoiser)
        values = {}  # per group: the predictions' values as the rollout's forwards made them (``replay_groups``)
        for n, group in enumerate(scored):
            micro = batcher.batching.micro_batch if batcher.batching else None
            differs = two_forwards or batcher.measuring or not reproduces(len(group.rows), group.forward_batch, micro)
            if exact and group.forward_batch and differs and affordable(group):
                walk, i = enter(group)
                values[n] = as_rolled_out(run, walk, i, group, lambda sel: inputs(walk, i, group.k, sel))
        for n, group in enumerate(scored):
            walk, i = enter(group)
            scorer = run.plan.scorer(walk, sampler)
            start = 0
            while start < len(group.rows):
                sel = group.rows[start:start + batcher.size(len(group.rows) - start)]
                fixed = {s: v[start:start + len(sel)] for s, v in values[n].items()} if n in values else None
                start += len(sel)
                index = torch.tensor(sel)
                x = inputs(walk, i, group.k, sel)
                with batcher.forward(len(sel)):
                    pred = _prediction(run, walk, i, x, sel, fixed, two_forwards, batcher.recompute, batcher.blocks)
                    result = scorer.score(x, pred, i, {s: ro.states[s][index, group.k + 1].to(dev) for s in streams})
                for s in streams:
                    out_lp[s][index, group.col] = result.stream_log_probs[s]  # type: ignore[index]
                    out_std[s][index, group.col] = result.std[s]  # type: ignore[index]
                    out_std_t[s][index, group.col] = result.std_t[s]  # type: ignore[index]
                    for j, row in enumerate(sel):
                        means[s][row][group.col] = result.mean[s][j]  # type: ignore[index]
    stacked = {s: torch.stack([torch.stack(m) for m in means[s]]) for s in streams}  # type: ignore[arg-type]
    return Replay(sum(out_lp.values()), out_lp, stacked, out_std, out_std_t,  # type: ignore[arg-type]
                  batching=batcher.batching)


def _prediction(run: Run, walk: Walk, i: int, x: Streams, rows: list[int], values: Streams | None,
                two_forwards: bool, recompute: bool = False, blocks: bool = False) -> Streams:
    """The prediction a replay scores: its ``values`` where given (the rollout's grouping, ``replay_groups``), else
    with ``two_forwards`` those of a forward without gradients (the rollout's kernels), carrying the gradients of a
    forward with them (``log_prob``'s ``exact``); without gradients, the values alone. With ``recompute`` the
    forward with gradients keeps nothing but its inputs and runs again inside the backward (``replay_memory``),
    under the adapter of its phase as now; with ``blocks`` the denoiser checkpoints its blocks in it, and again in
    its recomputation."""
    owner = walk.owner(i)

    def traced() -> Streams:
        set_adapter(run.spec, owner.phase, run.components, run.pipe.adapters)
        with blocks_checkpointed(owner.denoiser, blocks):
            return run.prediction(walk, i, x, rows=rows)

    def differentiable() -> Streams:
        return checkpoint(traced, use_reentrant=False) if recompute else traced()

    if values is not None and not torch.is_grad_enabled():
        return values
    if values is None and not two_forwards:
        return differentiable()
    if values is None:
        with torch.no_grad():
            values = run.prediction(walk, i, x, rows=rows)
    return {s: values[s] + (t - t.detach()) for s, t in differentiable().items()}  # t - t.detach() is 0 exactly
