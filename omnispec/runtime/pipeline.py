"""``Pipeline``: a built spec. ``__call__`` validates a request, then a ``Run`` encodes prompts and images,
walks the phases and the output phase is decoded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..policies import AppliedPolicies
from ..spec import PipelineSpec, explain_spec
from ..spec.guidance import NEGATIVE_TERMS
from ..spec.request import Request, resolve_request
from .distributed import ParallelContext, data_slice, gather_samples
from .families import Conditioning, Decoded, Family, Streams
from .run import Run


@dataclass
class Output:
    """``array``: decoded float32 in [0, 1], channels last, batch first; ``images`` (PIL) for image tasks,
    ``frames`` (one F x H x W x 3 array per sample) for video tasks; ``audio`` (B, channels, samples) float32
    at ``sample_rate`` for families with a sound track. ``latents``: the output phase's streams."""

    array: np.ndarray
    latents: Streams
    request: Request
    images: list[Any] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)
    audio: np.ndarray | None = None
    sample_rate: int | None = None

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
        return self.generate(self.request(prompt, seed, **request))

    def request(self, prompt: str | list[str], seed: int | list[int] | None = None, **fields: Any) -> Request:
        """A request resolved against the recipe's defaults and checked against the recipe and the family."""
        req = resolve_request(self.spec, prompt, seed, **fields)
        self.family.check_request(req)
        return req

    @torch.no_grad()
    def generate(self, request: Request, decode: bool = True) -> Output:
        """Run a resolved request; ``decode=False`` skips the VAE and leaves ``array`` empty. Under data
        parallelism each data group runs its share of the samples and every rank gets the whole output."""
        ctx = self.parallel
        if ctx is not None and ctx.data > 1:
            share = list(data_slice(ctx, len(request.prompts)))
            part = request.model_copy(update={"prompts": [request.prompts[i] for i in share],
                                              "seeds": [request.seeds[i] for i in share]})
            local = self._generate(part, decode) if share else None
            parts = [p for p in gather_samples(ctx, None if local is None else (
                local.array, {k: v.cpu() for k, v in local.latents.items()}, local.audio, local.sample_rate))
                if p is not None]
            latents = {k: torch.cat([lat[k] for _, lat, _, _ in parts]) for k in parts[0][1]}
            audio = np.concatenate([a for _, _, a, _ in parts]) if parts[0][2] is not None else None
            decoded = Decoded(np.concatenate([a for a, _, _, _ in parts]), audio, parts[0][3])
            return self._output(request, decoded, latents, decode)
        return self._generate(request, decode)

    def _generate(self, request: Request, decode: bool) -> Output:
        run = Run(self, request)
        results = run.execute()
        out = results[self.spec.recipe.output_index() or 0]
        decoded = self.family.decode(out.latents, out.geometry) if decode else Decoded(np.empty((0,), np.float32))
        return self._output(request, decoded, out.latents, decode)

    def _output(self, request: Request, decoded: Decoded, latents: Streams, decode: bool) -> Output:
        output = Output(array=decoded.array, latents=latents, request=request, audio=decoded.audio,
                        sample_rate=decoded.sample_rate)
        if not decode:
            return output
        if self.spec.recipe.task.endswith("video"):
            output.frames = [a for a in decoded.array]
        else:
            from PIL import Image

            output.images = [Image.fromarray(to_uint8(a).squeeze(-1) if a.shape[-1] == 1 else to_uint8(a))
                             for a in decoded.array]
        return output

    def encode(self, request: Request) -> tuple[Conditioning, Conditioning | None]:
        """Positive and (when a phase needs it) negative prompt encodings, one row per prompt. Each distinct
        prompt is encoded once and cached until the weights change; the key covers every conditioning input
        (a family may encode prompts together with the request's images)."""
        positive = self._encode_rows(request.prompts, request)
        negative = None
        if any(t.kind in NEGATIVE_TERMS for p in self.spec.recipe.phases for t in p.guidance.terms):
            negative = self._encode_rows([request.negative_prompt] * len(request.prompts), request)
        return positive, negative

    def _encode_rows(self, prompts: list[str], request: Request) -> Conditioning:
        unique = list(dict.fromkeys(prompts))
        key = (tuple(unique), request.max_sequence_length, request.image_digests, self.weight_version)
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

    # ---- introspection ----------------------------------------------------------------------------------

    def explain(self, **request: Any) -> dict[str, Any]:
        """The resolved plan (as ``omnispec explain``), with the sigmas this checkpoint actually walks."""
        req = resolve_request(self.spec, "", None, planning=True, **request)
        run = Run(self, req, encodings=(Conditioning({}), None))
        sigmas: dict[str, list[float]] = {}
        for walk in run.walks:
            for phase_run in walk.phases:
                sigmas[phase_run.phase.name] = [walk.steps.step_sigmas[i] for i in phase_run.indices]
        attention = {role: note for role, note in self.policies.attention.notes.items()}
        info = explain_spec(run.spec, req.steps, sigmas, attention=attention or None)
        info["applied"] = dict(self.policies.notes)
        return info


def to_uint8(a: np.ndarray) -> np.ndarray:
    return (np.clip(a, 0.0, 1.0) * 255).round().astype(np.uint8)
