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
from pydantic import TypeAdapter

from ..runtime.families import Conditioning, Streams
from ..runtime.run import Run, Walk
from ..runtime.samplers import StepResult, StochasticStepper, sde_generators, window_mask
from ..runtime.phases import set_adapter
from ..spec import APG, SpecError
from ..spec.policies import HOOKED_CACHES
from ..spec.recipe import STOCHASTIC_SAMPLERS, Sampler
from ..spec.request import Request

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline

_SAMPLER = TypeAdapter(Sampler)


@dataclass
class Rollout:
    """One rollout batch: B = prompts x group_size samples, W stochastic steps each (consecutive, in one walk)."""

    prompts: list[str]
    group_ids: torch.Tensor  # (B,)
    seeds: list[int]  # (B,) initial-noise seeds; SDE noise uses seed + SDE_SEED_OFFSET
    states: dict[str, torch.Tensor]  # per stream (B, W + 1, ...) float32: before each stochastic step, then after the last
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
        )


@dataclass
class Replay:
    log_probs: torch.Tensor  # (B, K), summed over streams
    stream_log_probs: dict[str, torch.Tensor]  # per stream (B, K)
    means: dict[str, torch.Tensor]  # per stream (B, K, ...) float32
    stds: dict[str, torch.Tensor]  # per stream (B, K)


def resolve_sampler(pipe: Pipeline, sampler: Any | None) -> Any:
    if sampler is None:
        return pipe.spec.recipe.phases[0].sampler
    if isinstance(sampler, Mapping):
        try:
            return _SAMPLER.validate_python(dict(sampler))
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported as a spec error
            raise SpecError.single(f"bad sampler: {exc}".splitlines()[0], "sampler") from None
    return sampler


def _check_rollout(pipe: Pipeline, sampler: Any) -> None:
    if sampler.kind not in STOCHASTIC_SAMPLERS:
        raise SpecError.single(f"rollouts need a stochastic sampler (one of {STOCHASTIC_SAMPLERS}), got "
                               f"{sampler.kind!r}; set recipe.phases.0.sampler or pass sampler=", "sampler")
    for i, phase in enumerate(pipe.spec.recipe.phases):
        if any(isinstance(t, APG) and t.momentum for t in phase.guidance.terms):
            raise SpecError.single("APG momentum carries state across steps, so single steps can't be replayed",
                                   f"recipe.phases.{i}.guidance")
    cache = pipe.policies.cache
    if cache is not None and cache.kind in HOOKED_CACHES:
        raise SpecError.single(f"the {cache.kind} cache decides per step from state a replay cannot rebuild, so a "
                               "cached rollout would not replay exactly; use cache kind step_mask (computing every "
                               "stochastic step) or none", "policies.cache.kind")
    if pipe.parallel is not None and pipe.parallel.data > 1:
        raise SpecError.single("rollouts split samples over processes with RolloutPool, not policies.parallel.data",
                               "policies.parallel.data")


def _window_walk(run: Run, mask: torch.Tensor) -> Walk:
    """The one walk every sample's window lies in (states are stored as consecutive transitions)."""
    used = torch.nonzero(mask.any(0)).flatten().tolist()
    if not used:
        raise SpecError.single("the window selects no step", "sampler.window")
    walks = {id(w): w for w in run.walks for g in used if w.offset + w.begin <= g < w.offset + len(w.steps)}
    if len(walks) != 1 or any(not (w.offset + w.begin <= g < w.offset + len(w.steps)) for w in walks.values()
                              for g in used):
        spans = ", ".join(f"{w.first.name}: steps {w.offset + w.begin}-{w.offset + len(w.steps) - 1}" for w in run.walks)
        raise SpecError.single(f"the window (steps {used[0]}-{used[-1]}) must lie within the steps one walk runs "
                               f"({spans})", "sampler.window")
    return next(iter(walks.values()))


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
    """Roll out ``prompts x group_size`` samples. Sample ``b`` (counting from ``sample_offset``, the position
    of this batch in a larger sharded one) starts from seed ``seed + b`` (``seed + group`` with
    ``shared_noise``) and draws its SDE noise on the pipeline's device from seed ``seed + b + 2**31``.
    The window counts steps over the whole request and must lie within one walk."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if sample_offset % group_size:
        raise ValueError("sample_offset must be a multiple of group_size")
    sampler = resolve_sampler(pipe, sampler)
    _check_rollout(pipe, sampler)
    expanded = [p for p in prompts for _ in range(group_size)]
    first_group = sample_offset // group_size
    group_ids = torch.arange(first_group, first_group + len(prompts)).repeat_interleave(group_size)
    seeds = [seed + (int(g) if shared_noise else sample_offset + b) for b, g in enumerate(group_ids)]
    req = pipe.request(expanded, seeds, **request)
    noise = sde_generators([seed + sample_offset + b for b in range(len(expanded))], pipe.device)

    run = Run(pipe, req)
    total = run.walks[-1].offset + len(run.walks[-1].steps)
    ids = torch.arange(sample_offset, sample_offset + len(expanded)) if sampler.window.kind == "random" and \
        sampler.window.scope == "sample" else group_ids
    mask = window_mask(sampler, total, ids, seed, start=run.walks[0].begin if len(run.walks) == 1 else 0)
    walk = _window_walk(run, mask)
    local = mask[:, walk.offset:walk.offset + len(walk.steps)]
    if pipe.policies.cache is not None and pipe.policies.cache.step_mask is not None:
        reused = [i for i in torch.nonzero(local.any(0)).flatten().tolist() if not pipe.policies.cache.computes(i)]
        if reused:
            raise SpecError.single(f"policies.cache.mask reuses stochastic step(s) {reused}; replay computes every "
                                   "step it scores, so the window's steps must compute", "policies.cache.mask")

    def stepper_for(w: Walk) -> StochasticStepper | None:
        if w is not walk:
            return None
        w.steps.check_stochastic("sampler")
        return StochasticStepper(sampler, w.steps.sigmas, local, noise)

    states: list[tuple[int, Streams, Streams, StepResult]] = []

    def observe(w: Walk, i: int, x_in: Streams, result: StepResult) -> None:
        if w is walk and bool(local[:, i].any()):
            states.append((i, {s: v.detach().float() for s, v in x_in.items()},
                           {s: v.detach().float() for s, v in result.next.items()}, result))

    run.stepper_for = stepper_for
    with torch.no_grad():
        results = run.execute(observe)
        out = results[pipe.spec.recipe.output_index() or 0]
        decoded = pipe.family.decode(out.latents, out.geometry)
    return _record(run, walk, local, states, prompts=expanded, group_ids=group_ids - first_group, seeds=seeds,
                   array=decoded.array, sampler=sampler, weight_version=pipe.weight_version)


def _record(run: Run, walk: Walk, mask: torch.Tensor, states: list[tuple[int, Streams, Streams, StepResult]],
            **fields: Any) -> Rollout:
    """Gather the observed steps into (B, W + 1, ...) states on the device, copied to the host once."""
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
        for s in stored:
            stored[s][rows_d, k_d] = x_in[s][rows_d]
            stored[s][rows_d, k_d + 1] = x_out[s][rows_d]
            per_stream[s][rows_d, k_d] = result.stream_log_probs[s][rows_d]  # type: ignore[index]
        idx[rows, k] = i
    sigmas = walk.steps.sigmas.cpu()
    return Rollout(
        states={s: v.cpu() for s, v in stored.items()}, log_probs=sum(per_stream.values()).cpu(),  # type: ignore[union-attr]
        stream_log_probs={s: v.cpu() for s, v in per_stream.items()}, sigmas=sigmas[idx],
        timesteps=walk.steps.timesteps.cpu().to(torch.float32)[idx], step_indices=idx + walk.offset,
        positive=run.positive, negative=run.negative, request=run.request, **fields,
    )


def log_prob(
    pipe: Pipeline,
    ro: Rollout,
    steps: Sequence[int] | None = None,
    grad: bool = True,
    micro_batch: int | None = None,
) -> Replay:
    """Recompute the log-prob of each stored transition ``states[:, k] -> states[:, k + 1]``.

    ``steps`` are positions in the window (default: all). Samples are replayed grouped by the step they
    were at, ``micro_batch`` samples per forward, through the same step body and stepper as the rollout.
    """
    _check_rollout(pipe, ro.sampler)
    run = Run(pipe, ro.request, encodings=(ro.positive, ro.negative))
    ks = list(range(ro.window)) if steps is None else list(steps)
    b = len(ro.prompts)
    streams = list(ro.states)
    out_lp = {s: torch.empty((b, len(ks)), dtype=torch.float32, device=pipe.device) for s in streams}
    out_std = {s: torch.empty((b, len(ks)), dtype=torch.float32, device=pipe.device) for s in streams}
    means: dict[str, list[list[torch.Tensor | None]]] = {s: [[None] * len(ks) for _ in range(b)] for s in streams}
    conditioned: set[int] = set()
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        for col, k in enumerate(ks):
            by_step: dict[int, list[int]] = {}
            for row in range(b):
                by_step.setdefault(int(ro.step_indices[row, k]), []).append(row)
            for g, rows in by_step.items():
                walk = next(w for w in run.walks if w.offset <= g < w.offset + len(w.steps))
                i = g - walk.offset
                if id(walk) not in conditioned:
                    run.condition(walk)
                    conditioned.add(id(walk))
                set_adapter(run.spec, walk.owner(i).phase, run.components)
                scorer = StochasticStepper(ro.sampler, walk.steps.sigmas, torch.zeros(0, 0, dtype=torch.bool), [])
                chunk = micro_batch or len(rows)
                for start in range(0, len(rows), chunk):
                    sel = rows[start:start + chunk]
                    index = torch.tensor(sel)
                    images = walk.images.rows(index) if walk.images is not None else None
                    x = pipe.family.reimpose({s: ro.states[s][index, k].to(pipe.device) for s in streams}, images,
                                             walk.geometry)
                    pred = run.prediction(walk, i, x, rows=sel)
                    result = scorer.score(x, pred, i, {s: ro.states[s][index, k + 1].to(pipe.device) for s in streams})
                    for s in streams:
                        out_lp[s][index, col] = result.stream_log_probs[s]  # type: ignore[index]
                        out_std[s][index, col] = result.std[s]  # type: ignore[index]
                        for j, row in enumerate(sel):
                            means[s][row][col] = result.mean[s][j]  # type: ignore[index]
    stacked = {s: torch.stack([torch.stack(m) for m in means[s]]) for s in streams}  # type: ignore[arg-type]
    return Replay(sum(out_lp.values()), out_lp, stacked, out_std)  # type: ignore[arg-type]
