"""``Pipeline``: a built spec. ``__call__`` validates a request, then a ``Run`` encodes prompts and images,
walks the phases and the output phase is decoded."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import records
from ..log import logger, timed
from ..policies import AppliedPolicies
from ..policies.vae import decode_in_memory
from ..spec import PipelineSpec, SpecError, SpecTypeError, explain_spec, render_explain
from ..spec.request import Request, request_problems, resolve_request
from .families import Conditioning, Decoded, Family, Geometry, Streams
from .lora import AdapterState
from .parallel import ParallelContext, data_slice, gather_outputs, is_padding
from .plan import RequestPlan, plan_request
from .run import Run


@dataclass
class Output:
    """``array``: decoded float32 in [0, 1], channels last, batch first; ``images`` (PIL) for image tasks,
    ``frames`` (one F x H x W x 3 array per sample) for video tasks; ``audio`` (B, channels, samples) float32
    at ``sample_rate`` for families with a sound track. ``latents``: the output phase's streams. ``provenance``:
    what made it (spec, request, checkpoint, versions), written into every saved file (``omnispec.records``)."""

    array: np.ndarray
    latents: Streams
    request: Request
    images: list[Any] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    provenance: dict[str, Any] | None = None

    def save(self, path: str | Path, *, overwrite: bool = False) -> list[Path]:
        """Write the outputs (``.png``/``.jpg``/``.webp`` per image, ``.gif``/``.mp4``/``.png`` per video, ``.npy``
        for the array; several as ``name-0.png`` ...), each through a temporary file renamed into place. An
        existing file is replaced only with ``overwrite=True``; a path that can't be written raises ``SpecError``
        naming it."""
        from ..records.outputs import check_output_path
        from .media import save_output

        if not isinstance(path, (str, os.PathLike)):
            raise SpecTypeError.single(f"expected a file path, got {type(path).__name__}", "path")
        path = Path(path)
        samples = len(self.images) or len(self.frames) or 1
        check_output_path(path, bool(self.frames), samples, overwrite=overwrite, where="path",
                          audio=self.audio is not None)
        return save_output(self, path, overwrite=overwrite)


class Pipeline:
    def __init__(self, spec: PipelineSpec, family: Family, components: dict[str, Any], device: torch.device,
                 policies: AppliedPolicies | None = None, parallel: ParallelContext | None = None):
        self.spec = spec
        self.family = family
        self.components = components
        self.device = device
        self.policies = policies or AppliedPolicies()
        self.parallel = parallel
        self.weight_version = 0  # bumped by every weight update; the prompt-embedding cache is emptied on a change
        self.checkpoint: dict[str, Any] | None = None  # where the weights came from (build sets it; outputs record it)
        self.weights: dict[str, str] = {}  # components whose weights are a single file or pre-quantized: what they are
        limit = spec.runtime.encoding_cache_bytes
        self._encodings = EncodingCache(default_cache_bytes(device) if limit is None else limit)
        self._encodings_version = 0
        self._spec_data: tuple[PipelineSpec, dict[str, Any]] | None = None
        self.adapters = AdapterState()  # LoRA slot scales set since build, the reference's "off"
        self._told: set[Hashable] = set()  # what was logged once: a size change, an unused negative prompt

    # ---- requests -------------------------------------------------------------------------------------

    def __call__(self, prompt: str | list[str], seed: int | list[int] | None = None, **request: Any) -> Output:
        """Generate: ``pipe(prompt, seed, **fields)`` is ``pipe.generate(pipe.request(prompt, seed, **fields))``;
        the arguments are checked as ``request`` checks them, before any work."""
        resolved = self.request(prompt, seed, **request)
        return self.generate(resolved)

    def request(self, prompt: str | list[str], seed: int | list[int] | None = None, **fields: Any) -> Request:
        """A request resolved against the recipe's defaults and checked against the recipe and the family.

        ``prompt``: a string or a non-empty list of strings. ``seed``: an int ``S`` (prompt ``i`` gets ``S + i``),
        a list with one int per prompt, or None (``runtime.seed``); every seed must lie in torch's ``manual_seed``
        range ``[-2**63, 2**64 - 1]``. ``fields``: ``negative_prompt``, ``height``, ``width``, ``frames``, ``fps``,
        ``steps``, ``sigmas`` (diffusers' ``sigmas=``: decreasing, in (0, 1], one step each), ``guidance_scale``,
        ``max_sequence_length``, ``strength``, ``image``, ``conditions``, each
        within the recipe's constraints and README's limits; numbers must be finite and not ``bool``/``str``.
        Raises ``SpecTypeError`` (a ``TypeError``) for an argument of the wrong type or an unknown field and
        ``SpecError`` (a ``ValueError``) for a wrong value, each naming the argument and what was expected.
        """
        req = resolve_request(self.spec, prompt, seed, **fields)
        self.family.check_request(req, self.spec)
        if req.negative_prompt and not self._negative_passes() and "negative" not in self._told:
            self._told.add("negative")  # diffusers takes it and ignores it too; say so once
            logger.warning(f"recipe {self.spec.name!r} runs no negative-prompt pass (no cfg, true_cfg, apg or "
                           "cfg_zero_star term): the negative prompt changes nothing")
        return req

    def _negative_passes(self) -> bool:
        return any(p.guidance.negative for p in self.spec.recipe.phases)

    @torch.no_grad()
    def generate(self, request: Request, decode: bool = True) -> Output:
        """Run a resolved request (from ``request``); ``decode=False`` skips the VAE and leaves ``array`` empty.
        Under data parallelism each data group runs its share of the samples and every rank gets the whole
        output. A request that isn't a ``Request``, or breaks this recipe's constraints (one resolved by another
        pipeline), raises ``SpecTypeError``/``SpecError`` before any work."""
        if not isinstance(request, Request):
            raise SpecTypeError.single(f"expected a Request (from pipe.request(...)), got {type(request).__name__}; "
                                       "call pipe(prompt, ...) to generate from a prompt", "request")
        if not isinstance(decode, bool):
            raise SpecTypeError.single(f"expected True or False, got {type(decode).__name__}", "decode")
        problems = request_problems(self.spec, request)
        if problems:
            raise SpecError(problems)
        self.family.check_request(request, self.spec)
        record = self._record(request)
        plan = self.plan(request)
        padding = is_padding(self.parallel, len(request.prompts))  # run only to keep a shard group in step
        latents, decoded = self._run(plan, decode and not padding)
        if plan.share is not None:  # every rank gets the whole output
            if padding:
                latents, decoded = {}, Decoded(np.empty((0,), np.float32))
            latents, decoded = gather_outputs(self.parallel, latents, decoded)
        return Output(array=decoded.array, latents=latents, request=request, audio=decoded.audio,
                      sample_rate=decoded.sample_rate, provenance=record, **self._media(decoded, decode))

    def _run(self, plan: RequestPlan, decode: bool) -> tuple[Streams, Decoded]:
        """The output phase's latents, and their decoding (empty with ``decode=False``)."""
        if not plan.request.prompts:  # a data group with no sample of this request
            return {}, Decoded(np.empty((0,), np.float32))
        out = Run(self, plan).execute()[self.spec.recipe.output_index() or 0]
        if not decode:
            return out.latents, Decoded(np.empty((0,), np.float32))
        with timed(f"decoding {len(plan.request.prompts)} sample(s)"):
            return out.latents, self.decode(out.latents, out.geometry)

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """The family's decode of a batch, sliced if the batch at once would not fit the device
        (``policies.vae.decode_in_memory``)."""
        samples = next(iter(latents.values())).shape[0] if latents else 0
        return decode_in_memory(self.spec, self.components, lambda: self.family.decode(latents, geometry), samples)

    def _media(self, decoded: Decoded, decode: bool) -> dict[str, list[Any]]:
        """The decoded samples as a video task's frames or an image task's PIL images."""
        if not decode:
            return {}
        if self.spec.recipe.task.endswith("video"):
            return {"frames": [a for a in decoded.array]}
        from PIL import Image

        return {"images": [Image.fromarray(to_uint8(a).squeeze(-1) if a.shape[-1] == 1 else to_uint8(a))
                           for a in decoded.array]}

    def _record(self, request: Request) -> dict[str, Any]:
        """What made this request's outputs (the spec's data is made once per spec)."""
        if self._spec_data is None or self._spec_data[0] is not self.spec:
            self._spec_data = (self.spec, records.spec_data(self.spec))
        return records.make_record(self._spec_data[1], request, str(self.device), self.checkpoint, self.weight_version,
                                   self.generated_size(request), self.preset_record())

    def preset_record(self) -> dict[str, Any] | None:
        """What ``policies.preset`` turned on and left out at build on this device, as an output's record says it;
        None without a preset."""
        preset = self.policies.preset
        return preset.record() if preset is not None and preset.name != "none" else None

    def generated_size(self, request: Request) -> tuple[int, int] | None:
        """The (height, width) the output phase generates for ``request``: the request's, or what the family derives
        (an editing model's area rule, the input image's size). A size other than the one asked for is logged
        once per pipeline and pair of sizes."""
        phase = self.spec.recipe.phases[self.spec.recipe.output_index() or 0]
        geometry = self.family.geometry(request, phase.size_scale)
        if not geometry.height or not geometry.width:
            return None
        size = (geometry.height, geometry.width)
        asked = (request.height, request.width)
        if size != asked and (asked, size) not in self._told:
            self._told.add((asked, size))
            what = "no size was given: from the input image" if asked == (None, None) else \
                f"{asked[1]}x{asked[0]} was asked for"
            logger.info(f"generating at {size[1]}x{size[0]} ({what}); the output's record keeps both")
        return size

    def encode(self, request: Request) -> tuple[Conditioning, Conditioning | None]:
        """Positive and (when a phase needs it) negative prompt encodings, one row per prompt. Each distinct
        prompt is encoded once and cached until the weights change; the key covers every conditioning input
        (a family may encode prompts together with the request's images)."""
        positive = self._encode_rows(request.prompts, request)
        negative = None
        if self._negative_passes():
            negative = self._encode_rows([request.negative_prompt] * len(request.prompts), request)
        return positive, negative

    def _encode_rows(self, prompts: list[str], request: Request) -> Conditioning:
        if self._encodings_version != self.weight_version:  # encodings of older weights are never used again
            self._encodings.clear()
            self._encodings_version = self.weight_version
        unique = list(dict.fromkeys(prompts))
        key = (tuple(unique), request.max_sequence_length, request.condition_digests)
        encoded = self._encodings.get(key)
        if encoded is None:
            encoded = self.family.encode(unique, request)
            self._encodings.put(key, encoded, extra_bytes=sum(len(p) for p in unique))
        if unique == prompts:
            return encoded
        return encoded.rows(torch.tensor([unique.index(p) for p in prompts]))

    def plan(self, request: Request, *, rollout: dict[str, Any] | None = None) -> RequestPlan:
        """What ``request`` runs on this pipeline (``runtime.plan``), planned once for every use of it."""
        ctx = self.parallel
        share = data_slice(ctx, len(request.prompts)) if ctx is not None and ctx.samples > 1 else None
        return plan_request(self.spec, self.family, self.components, self.device, request, rollout=rollout,
                            share=share)

    # ---- introspection ----------------------------------------------------------------------------------

    def explain(self, *, as_dict: bool = False, **request: Any) -> str | dict[str, Any]:
        """The resolved plan as ``omnispec explain`` prints it, with the sigmas this checkpoint actually walks and
        the policies as applied here; ``as_dict=True`` gives the same as a JSON-ready dict (``--json``).
        ``request`` fields (``steps``, ``height`` ...) plan a request other than the recipe's defaults."""
        req = resolve_request(self.spec, "", None, planning=True, **request)
        plan = self.plan(req)
        applied = self.policies.attention
        info = explain_spec(plan.spec, req.steps, plan.sigmas(), attention=dict(applied.notes) or None,
                            attention_with_gradients=dict(applied.training_notes) or None, weights=self.weights)
        info["applied"] = dict(self.policies.notes)
        return info if as_dict else render_explain(info)


class EncodingCache:
    """Prompt encodings by key, bounded in bytes (every tensor of an entry, plus its prompts' length); the least
    recently used entry goes first, and an entry larger than the whole bound is not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[Hashable, tuple[Conditioning, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Conditioning | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: Conditioning, extra_bytes: int = 0) -> None:
        size = conditioning_bytes(value) + extra_bytes
        if key in self._entries:
            self.nbytes -= self._entries.pop(key)[1]
        if size > self.max_bytes:
            return
        while self._entries and self.nbytes + size > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1][1]
        self._entries[key] = (value, size)
        self.nbytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def conditioning_bytes(value: Conditioning) -> int:
    tensors = {id(t): t for t in (*value.batched.values(), *value.shared.values()) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def default_cache_bytes(device: torch.device) -> int:
    """1% of the device's memory (the host's for a CPU); 256 MiB where it can't be read."""
    total = None
    try:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        elif device.type == "cpu":
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        total = None
    return total // 100 if total else 256 << 20


def to_uint8(a: np.ndarray) -> np.ndarray:
    return (np.clip(a, 0.0, 1.0) * 255).round().astype(np.uint8)
