"""The denoiser on a rollout's request at states the trainer makes (forward-process training, DiffusionNFT): the
prediction at a given state for a step of the request, through the same conditioning, guidance and adapters as the
rollout's steps, without a stepper or a log-prob."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ..runtime.families import Streams
from ..runtime.phases import set_adapter
from ..runtime.run import Run
from ..spec import SpecError, SpecTypeError
from .checks import check_pipeline
from .rollout import Rollout

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline


class Denoiser:
    """``denoiser(pipe, ro)``: ``sigmas(steps)`` and ``predict(states, steps)`` for the rollout's samples, where
    ``steps`` (one per sample, ``(B,)``) count over the whole request, as ``Rollout.step_indices`` do; the attribute
    ``steps`` lists those that run (every step of the request's walks)."""

    def __init__(self, pipe: Pipeline, ro: Rollout):
        if not isinstance(ro, Rollout):
            raise SpecTypeError.single(f"expected an omnispec.rl.Rollout (what Pipeline.rollout returns), got "
                                       f"{type(ro).__name__}", "rollout")
        check_pipeline(pipe)
        self.pipe, self.ro = pipe, ro
        self.run = Run(pipe, pipe.plan(ro.request), encodings=(ro.positive, ro.negative), trains=True)
        self._conditioned: set[int] = set()
        self.steps = [w.offset + i for w in self.run.plan.walks for i in range(w.begin, len(w.steps))]

    def sigmas(self, steps: torch.Tensor) -> torch.Tensor:
        """``(B,)`` float32: each step's noise level (the state a prediction at that step expects)."""
        out = []
        for g in self._check(steps):
            walk = self.run.plan.walk_of(g)
            out.append(walk.steps.sigmas[g - walk.offset].float().cpu())
        return torch.stack(out)

    def predict(self, states: torch.Tensor | Mapping[str, torch.Tensor], steps: torch.Tensor) -> Streams:
        """The prediction (the velocity, with the request's guidance) at ``states`` (one per sample, a tensor for a
        single-stream family or a dict of streams) for each sample's step; with gradients where the caller has
        them on. Samples at the same step share forwards."""
        x_all = dict(states) if isinstance(states, Mapping) else {next(iter(self.ro.states)): states}
        if set(x_all) != set(self.ro.states):
            raise SpecError.single(f"expected streams {sorted(self.ro.states)}, got {sorted(x_all)}", "states")
        b = len(self.ro.prompts)
        for s, v in x_all.items():
            if tuple(v.shape) != (b, *self.ro.states[s].shape[2:]):
                raise SpecError.single(f"stream {s!r}: expected shape {(b, *self.ro.states[s].shape[2:])}, got "
                                       f"{tuple(v.shape)}", "states")
        by_step: dict[int, list[int]] = {}
        for row, g in enumerate(self._check(steps)):
            by_step.setdefault(g, []).append(row)
        dev = self.pipe.device
        parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {s: [] for s in x_all}
        for g, rows in by_step.items():
            walk = self.run.plan.walk_of(g)
            i = g - walk.offset
            if id(walk) not in self._conditioned:
                self.run.condition(walk)
                self._conditioned.add(id(walk))
            set_adapter(self.run.spec, walk.owner(i).phase, self.run.components, self.pipe.adapters)
            index = torch.tensor(rows)
            images = walk.images.rows(index) if walk.images is not None else None
            x = self.pipe.family.reimpose({s: v[index].to(dev) for s, v in x_all.items()}, images, walk.geometry,
                                          float(walk.steps.sigmas[i]))
            pred = self.run.prediction(walk, i, x, rows=rows)
            for s in x_all:
                parts[s].append((rows, pred[s]))
        out = {}
        for s, chunks in parts.items():
            order = torch.tensor([r for rows, _ in chunks for r in rows])
            stacked = torch.cat([p for _, p in chunks])
            out[s] = stacked[torch.argsort(order).to(stacked.device)]
        return out

    def _check(self, steps: torch.Tensor) -> list[int]:
        values = torch.as_tensor(steps).flatten().tolist()
        if len(values) != len(self.ro.prompts):
            raise SpecError.single(f"expected one step per sample ({len(self.ro.prompts)}), got {len(values)}",
                                   "steps")
        bad = sorted({g for g in values if g not in self.steps})
        if bad:
            raise SpecError.single(f"steps {bad} are not trainable steps of this request ({self.steps[0]}-"
                                   f"{self.steps[-1]} in its walks)", "steps")
        return [int(g) for g in values]


def denoiser(pipe: Pipeline, ro: Rollout) -> Denoiser:
    """The denoiser on ``ro``'s request (its prompts' encodings, guidance and phases) at states the caller makes."""
    return Denoiser(pipe, ro)


__all__ = ["Denoiser", "denoiser"]
