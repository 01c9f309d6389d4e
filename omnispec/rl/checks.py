"""Argument and state checks of ``rollout`` and ``log_prob``: every misfit is found before the first forward
and named by the argument or ``Rollout`` field it is in (``SpecTypeError`` for a wrong type, ``SpecError`` for a
wrong value), so a trainer's bug never surfaces as an ``IndexError`` from inside a step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..runtime.families import Conditioning
from ..runtime.samplers import SDE_SEED_OFFSET
from ..spec import SpecError, SpecTypeError
from ..spec.base import SEED_MAX, SEED_MIN
from ..spec.guidance import term_of
from ..spec.request import Request

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline
    from ..runtime.run import Run
    from .rollout import Rollout


def check_pipeline(pipe: Pipeline) -> None:
    """What a pipeline must satisfy for its rollouts to replay exactly."""
    for i, phase in enumerate(pipe.spec.recipe.phases):
        for term in phase.guidance.terms:
            refusal = term_of(term).replay_refusal(term)
            if refusal:
                raise SpecError.single(refusal, f"recipe.phases.{i}.guidance")
    cache = pipe.policies.cache
    if cache is not None and cache.policy.hooked:
        raise SpecError.single(f"the {cache.kind} cache decides per step from state a replay cannot rebuild, so a "
                               "cached rollout would not replay exactly; use cache kind step_mask (computing every "
                               "stochastic step), the sampler's outside_window, or none", "policies.cache.kind")
    policies = pipe.spec.policies
    for name, component in pipe.spec.model.components.items():
        key = policies.quantization_key(name, component.role) if component.role == "denoiser" else None
        q = policies.quantization[key] if key is not None else None
        if q is not None and q.method == "fp8_dynamic" and q.granularity != "row":
            raise SpecError.single(
                f"fp8_dynamic with per-tensor scales (granularity {q.granularity or 'unset: torchao defaults to tensor'}) "
                "takes one activation scale over every row of a forward, so a sample's log-probs would depend on the "
                "samples batched with it and a replay at another micro-batch would not be exact; set granularity: row",
                f"policies.quantization.{key}.granularity")
    if pipe.parallel is not None and pipe.parallel.samples > 1:
        axis = "data" if pipe.parallel.data > 1 else "shard"
        raise SpecError.single(f"rollouts split samples over processes with RolloutPool, not policies.parallel.{axis}",
                               f"policies.parallel.{axis}")


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_rollout_args(prompts: Any, group_size: Any, seed: Any, shared_noise: Any, sample_offset: Any
                       ) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    elif not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        got = type(prompts).__name__ if not isinstance(prompts, Sequence) else \
            f"a sequence holding {type(next(p for p in prompts if not isinstance(p, str))).__name__}"
        raise SpecTypeError.single(f"expected a prompt string or a sequence of them, got {got}", "prompts")
    if not prompts:
        raise SpecError.single("expected at least one prompt", "prompts")
    for name, value in (("group_size", group_size), ("seed", seed), ("sample_offset", sample_offset)):
        if not is_int(value):
            raise SpecTypeError.single(f"expected an int, got {type(value).__name__}", name)
    if not isinstance(shared_noise, bool):
        raise SpecTypeError.single(f"expected a bool, got {type(shared_noise).__name__}", "shared_noise")
    if group_size < 1:
        raise SpecError.single(f"expected at least 1 sample per prompt, got {group_size}", "group_size")
    if sample_offset < 0 or sample_offset % group_size:
        raise SpecError.single(f"expected a multiple of group_size ({group_size}) >= 0, got {sample_offset}",
                               "sample_offset")
    last = seed + sample_offset + len(prompts) * group_size - 1 + SDE_SEED_OFFSET
    if seed < SEED_MIN or last > SEED_MAX:
        raise SpecError.single(f"seed {seed} puts a sample's SDE-noise seed (seed + sample + 2**31, up to {last}) "
                               f"outside torch's seed range [{SEED_MIN}, {SEED_MAX}]", "seed")
    return list(prompts)


def check_replay_args(steps: Any, grad: Any, micro_batch: Any, exact: Any, window: int) -> list[int]:
    for name, value in (("grad", grad), ("exact", exact)):
        if not isinstance(value, bool):
            raise SpecTypeError.single(f"expected a bool, got {type(value).__name__}", name)
    if micro_batch is not None:
        if not is_int(micro_batch):
            raise SpecTypeError.single(f"expected an int or None, got {type(micro_batch).__name__}", "micro_batch")
        if micro_batch < 1:
            raise SpecError.single(f"expected at least 1 sample per forward, got {micro_batch}", "micro_batch")
    if steps is None:
        return list(range(window))
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not all(is_int(k) for k in steps):
        raise SpecTypeError.single("expected a sequence of window positions (ints) or None, got "
                                   f"{type(steps).__name__}", "steps")
    if not steps:
        raise SpecError.single("expected at least one window position", "steps")
    bad = [int(k) for k in steps if not 0 <= k < window]
    if bad:
        raise SpecError.single(f"positions {bad} are outside the rollout's window of {window} steps "
                               f"(0-{window - 1})", "steps")
    return [int(k) for k in steps]


def shape_of(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def check_rollout_fits(pipe: Pipeline, ro: Rollout, run: Run) -> None:
    """That ``ro`` is intact and was made by a pipeline like this one for this request: its batch, streams,
    shapes, dtypes, window and steps; raised before any forward, naming the field."""
    tensors = {"group_ids": ro.group_ids, "log_probs": ro.log_probs, "sigmas": ro.sigmas, "timesteps": ro.timesteps,
               "step_indices": ro.step_indices}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise SpecTypeError.single(f"expected a tensor, got {type(value).__name__}", f"rollout.{name}")
    if not isinstance(ro.states, Mapping) or not all(isinstance(v, torch.Tensor) for v in ro.states.values()):
        raise SpecTypeError.single("expected a dict of stream name -> tensor", "rollout.states")
    if not isinstance(ro.request, Request) or not isinstance(ro.positive, Conditioning):
        raise SpecTypeError.single("the rollout's request and encodings are not what Pipeline.rollout stores",
                                   "rollout.request" if not isinstance(ro.request, Request) else "rollout.positive")
    if not isinstance(ro.prompts, list) or not all(isinstance(p, str) for p in ro.prompts):
        raise SpecTypeError.single("expected a list of prompt strings", "rollout.prompts")
    b = len(ro.prompts)
    if ro.log_probs.ndim != 2 or ro.log_probs.shape[0] != b or ro.log_probs.shape[1] < 1:
        raise SpecError.single(f"expected shape ({b}, W) with W >= 1 (one row per prompt x group sample), got "
                               f"{shape_of(ro.log_probs)}", "rollout.log_probs")
    w = ro.window
    for name in ("sigmas", "timesteps", "step_indices"):
        if tuple(tensors[name].shape) != (b, w):
            raise SpecError.single(f"expected shape {(b, w)}, got {shape_of(tensors[name])}", f"rollout.{name}")
    if tuple(ro.group_ids.shape) != (b,) or len(ro.seeds) != b or len(ro.request.prompts) != b:
        raise SpecError.single(f"{b} prompts, but {len(ro.group_ids)} group ids, {len(ro.seeds)} seeds and "
                               f"{len(ro.request.prompts)} request prompts", "rollout")
    if ro.positive.batch_size != b or (ro.negative is not None and ro.negative.batch_size != b):
        raise SpecError.single(f"encodings for {ro.positive.batch_size} samples, the rollout has {b}",
                               "rollout.positive")
    for name in ("log_probs", "sigmas", "timesteps"):
        if tensors[name].dtype != torch.float32:
            raise SpecError.single(f"expected float32, got {tensors[name].dtype}", f"rollout.{name}")
    if ro.forward_batch is not None and (not isinstance(ro.forward_batch, torch.Tensor) or
                                         tuple(ro.forward_batch.shape) != (b,) or ro.forward_batch.is_floating_point()
                                         or bool((ro.forward_batch < 1).any())):
        raise SpecError.single(f"expected None or an integer tensor of shape ({b},) with every count at least 1, got "
                               f"{shape_of(ro.forward_batch)}", "rollout.forward_batch")
    if ro.step_indices.dtype not in (torch.int64, torch.int32):
        raise SpecError.single(f"expected an integer tensor, got {ro.step_indices.dtype}", "rollout.step_indices")
    streams = list(pipe.family.streams)
    if sorted(ro.states) != sorted(streams):
        raise SpecError.single(f"streams {sorted(ro.states)}, but family {pipe.family.name!r} denoises {streams}",
                               "rollout.states")
    idx = ro.step_indices.long()
    if w > 1 and bool((idx[:, 1:] != idx[:, :-1] + 1).any()):
        raise SpecError.single("each sample's steps must be consecutive (one window per sample)",
                               "rollout.step_indices")
    for row_first, row_last in {(int(a), int(z)) for a, z in zip(idx[:, 0], idx[:, -1])}:
        walk = next((x for x in run.walks if x.offset + x.begin <= row_first and row_last < x.offset + len(x.steps)),
                    None)
        if walk is None:
            spans = ", ".join(f"{x.offset + x.begin}-{x.offset + len(x.steps) - 1}" for x in run.walks)
            raise SpecError.single(f"steps {row_first}-{row_last} do not lie within one walk of this pipeline's "
                                   f"plan for the request (steps {spans})", "rollout.step_indices")
    expected_sigmas = torch.cat([x.steps.sigmas.cpu()[:-1] for x in run.walks])
    if not torch.equal(expected_sigmas[idx], ro.sigmas.cpu()):
        raise SpecError.single("the stored sigmas are not the ones this pipeline steps at those steps (a rollout "
                               "of another schedule, step count or pipeline)", "rollout.sigmas")
    window_walk = next(x for x in run.walks if x.offset <= int(idx[0, 0]) < x.offset + len(x.steps))
    expected = pipe.family.initial_latents(window_walk.geometry, [torch.Generator("cpu").manual_seed(0)])
    for s in streams:
        state = ro.states[s]
        want = (b, w + 1, *expected[s].shape[1:])
        if tuple(state.shape) != want:
            raise SpecError.single(f"expected shape {want} (samples, window + 1, the stream's latent shape), got "
                                   f"{tuple(state.shape)}", f"rollout.states.{s}")
        if state.dtype != torch.float32:
            raise SpecError.single(f"expected float32 states, got {state.dtype}", f"rollout.states.{s}")
