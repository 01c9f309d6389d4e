"""``Pipeline``: a built spec. ``__call__`` validates a request, encodes prompts once, runs the phases
and decodes the output phase."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..policies import AppliedPolicies
from ..spec import PipelineSpec, SkipLayer, explain_spec
from ..spec.guidance import NEGATIVE_TERMS, pass_name
from ..spec.recipe import Phase
from ..spec.request import Request, resolve_request
from .families import Conditioning, Family
from .distributed import ParallelContext, data_slice, gather_samples
from .loop import Passes, StepHook
from .phases import phase_groups, planned_steps, run_phases


@dataclass
class Output:
    """``array``: decoded float32 in [0, 1], channels last, batch first; ``images`` (PIL) for image
    tasks, ``frames`` (one F x H x W x 3 array per sample) for video tasks."""

    array: np.ndarray
    latents: torch.Tensor
    request: Request
    images: list[Any] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)

    def save(self, path: str | Path) -> list[Path]:
        from .media import save_output

        return save_output(self, Path(path))


class Pipeline:
    def __init__(self, spec: PipelineSpec, family: Family, components: dict[str, Any], device: torch.device,
                 policies: AppliedPolicies | None = None, parallel: ParallelContext | None = None):
        self.spec = spec
        self.family = family
        self.components = components
        self.device = device
        self.policies = policies or AppliedPolicies()
        self.parallel = parallel
        self.weight_version = 0  # bumped by every weight update; keys the prompt-embedding cache
        self._encodings: dict[tuple, Conditioning] = {}

    # ---- requests -------------------------------------------------------------------------------------

    def __call__(self, prompt: str | list[str], seed: int | list[int] | None = None, **request: Any) -> Output:
        req = resolve_request(self.spec, prompt, seed, **request)
        return self.generate(req)

    @torch.no_grad()
    def generate(self, request: Request, on_step: StepHook | None = None, decode: bool = True) -> Output:
        """Run a resolved request; ``decode=False`` skips the VAE and leaves ``array`` empty. Under data
        parallelism each data group runs its share of the samples and every rank gets the whole output."""
        ctx = self.parallel
        if ctx is not None and ctx.data > 1:
            share = list(data_slice(ctx, len(request.prompts)))
            part = request.model_copy(update={"prompts": [request.prompts[i] for i in share],
                                              "seeds": [request.seeds[i] for i in share]})
            local = self._generate(part, on_step, decode) if share else None
            parts = [p for p in gather_samples(ctx, None if local is None else
                                               (local.array, local.latents.cpu())) if p is not None]
            array = np.concatenate([a for a, _ in parts])
            latents = torch.cat([lat for _, lat in parts])
            return self._output(request, array, latents, decode)
        return self._generate(request, on_step, decode)

    def _generate(self, request: Request, on_step: StepHook | None, decode: bool) -> Output:
        spec = self.spec_for(request)
        cache = self.policies.cache
        if cache is not None:
            cache.reset()  # no cache state crosses requests
        positive, negative = self.encode(request)
        generators = [torch.Generator("cpu").manual_seed(s) for s in request.seeds]
        results = run_phases(
            spec, self.family, self.components, request,
            lambda phase: phase_passes(phase, positive, negative), generators, device=self.device, on_step=on_step,
            cache=cache, parallel=self.parallel,
        )
        out = results[spec.recipe.output_index() or 0]
        array = self.family.decode(out.latents, out.geometry) if decode else np.empty((0,), np.float32)
        return self._output(request, array, out.latents, decode)

    def _output(self, request: Request, array: np.ndarray, latents: torch.Tensor, decode: bool) -> Output:
        output = Output(array=array, latents=latents, request=request)
        if not decode:
            return output
        if self.spec.recipe.task.endswith("video"):
            output.frames = [a for a in array]
        else:
            from PIL import Image

            output.images = [Image.fromarray(_to_uint8(a).squeeze(-1) if a.shape[-1] == 1 else _to_uint8(a))
                             for a in array]
        return output

    def encode(self, request: Request) -> tuple[Conditioning, Conditioning | None]:
        """Positive and (when a phase needs it) negative prompt encodings, one row per prompt. Each distinct
        prompt is encoded once and cached until the weights change."""
        positive = self._encode_rows(request.prompts, request)
        negative = None
        if any(t.kind in NEGATIVE_TERMS for p in self.spec.recipe.phases for t in p.guidance.terms):
            negative = self._encode_rows([request.negative_prompt] * len(request.prompts), request)
        return positive, negative

    def _encode_rows(self, prompts: list[str], request: Request) -> Conditioning:
        unique = list(dict.fromkeys(prompts))
        key = (tuple(unique), request.max_sequence_length, self.weight_version)
        if key not in self._encodings:
            if len(self._encodings) >= 64:
                self._encodings.pop(next(iter(self._encodings)))
            self._encodings[key] = self.family.encode(unique, request)
        encoded = self._encodings[key]
        if unique == prompts:
            return encoded
        return encoded.rows(torch.tensor([unique.index(p) for p in prompts]))

    def spec_for(self, request: Request) -> PipelineSpec:
        """The spec with the request's ``guidance_scale`` applied to every phase's primary scale."""
        if request.guidance_scale is None:
            return self.spec
        phases = [p.model_copy(update={"guidance": p.guidance.with_primary_scale(request.guidance_scale)})
                  for p in self.spec.recipe.phases]
        return self.spec.model_copy(update={"recipe": self.spec.recipe.model_copy(update={"phases": phases})})

    # ---- RL: rollouts, replay, weight sync (omnispec.rl) --------------------------------------------------

    def rollout(self, prompts: str | list[str], group_size: int = 1, seed: int = 0, sampler: Any = None,
                shared_noise: bool = False, **request: Any):
        """Batched SDE rollouts with per-step log-probs; see ``omnispec.rl.rollout``."""
        from ..rl.rollout import rollout

        return rollout(self, prompts, group_size, seed, sampler, shared_noise, **request)

    def log_prob(self, rollout: Any, steps: Any = None, grad: bool = True, micro_batch: int | None = None):
        """Replay stored transitions through the same code, with gradients; see ``omnispec.rl.log_prob``."""
        from ..rl.rollout import log_prob

        return log_prob(self, rollout, steps, grad, micro_batch)

    # ---- introspection ----------------------------------------------------------------------------------

    def explain(self, **request: Any) -> dict[str, Any]:
        """The resolved plan (as ``omnispec explain``), with the sigmas this checkpoint actually walks."""
        req = resolve_request(self.spec, "", None, **request)
        spec = self.spec_for(req)
        sigmas: dict[str, list[float]] = {}
        for group in phase_groups(spec):
            steps, owned = planned_steps(spec, self.family, group, req, self.components, self.device)
            for k, idx in enumerate(group):
                sigmas[spec.recipe.phases[idx].name] = [steps.sigmas[i] for i in owned[k]]
        attention = {role: note for role, note in self.policies.attention.notes.items()}
        info = explain_spec(spec, req.steps, sigmas, attention=attention or None)
        info["applied"] = dict(self.policies.notes)
        return info


def phase_passes(phase: Phase, positive: Conditioning, negative: Conditioning | None) -> Passes:
    conditions = {"cond": positive}
    perturbations: dict[str, SkipLayer | None] = {"cond": None}
    for term in phase.guidance.terms:
        name = pass_name(term)
        if term.kind in NEGATIVE_TERMS:
            assert negative is not None
            conditions[name], perturbations[name] = negative, None
        elif isinstance(term, SkipLayer):
            conditions[name], perturbations[name] = positive, term
        else:
            raise NotImplementedError(f"{term.kind} passes need a family with modalities")
    return Passes(conditions, perturbations)


def _to_uint8(a: np.ndarray) -> np.ndarray:
    return (np.clip(a, 0.0, 1.0) * 255).round().astype(np.uint8)
