"""Patch-parallel VAE decode: the tiles of diffusers' tiled decode spread over the ``vae_patch`` ranks that hold the
same latents, each tile decoded by one rank and broadcast to the others, the blend left to diffusers.

Peers rewrite the tile loop (xDiT's DistVAE re-implements the VAE's convolutions with halo exchange; others copy
diffusers' loop into a distributed one). Here diffusers' own ``decode`` runs twice and only its decoder calls are
replaced: the first run records every call (a rank computes the calls of the tiles it owns and, for the others,
only their output shapes on a meta-device copy of the decoder); the owners broadcast their outputs; the second run
replays the gathered outputs in call order. Blending, cropping and clamping are diffusers' code, so the output equals
one process's tiled decode exactly, whatever the VAE's loop (per-tile, per-frame with a feature cache, temporal)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ...spec import PipelineSpec, SpecError
from ...targets import Targets
from .base import Axis
from .context import ParallelContext


class VaePatchAxis(Axis):
    def distribute(self, ctx: ParallelContext, spec: PipelineSpec, targets: Targets,
                   modules: dict[str, torch.nn.Module], device: torch.device) -> None:
        vaes = {n: modules[n] for n, c in spec.model.components.items() if c.role == "vae"}
        tiled = {n: v for n, v in vaes.items() if hasattr(v, "use_tiling") and hasattr(v, "decoder")}
        if not tiled:
            raise SpecError.single(f"vae_patch spreads diffusers' VAE tiles over ranks, and no VAE of family "
                                   f"{targets.family!r} ({', '.join(type(v).__name__ for v in vaes.values())}) tiles",
                                   "policies.parallel.vae_patch")
        for name, vae in tiled.items():
            noisy = [k for k, v in vae.config.items() if "inject_noise" in k and (any(v) if isinstance(
                v, (list, tuple)) else bool(v))]
            if noisy:
                raise SpecError.single(f"{name}'s decoder draws noise ({noisy[0]}), so ranks decoding different "
                                       "tiles would not draw what one process draws", "policies.parallel.vae_patch")
            vae.decode = PatchDecode(vae, ctx)  # an instance attribute: the class's decode is left as it is


VAE_PATCH = VaePatchAxis()


class PatchDecode:
    """``vae.decode`` with its decoder calls shared among ``ctx.vae_group``."""

    def __init__(self, vae: torch.nn.Module, ctx: ParallelContext):
        self.vae = vae
        self.decode = type(vae).decode.__get__(vae)
        self.ranks = dist.get_process_group_ranks(ctx.vae_group)
        self.group, self.index = ctx.vae_group, ctx.vae_index
        self._meta: torch.nn.Module | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decoder = self.vae.decoder
        # (owning rank's index, input shape, the output if computed here, the output or its meta twin)
        calls: list[tuple[int, tuple[int, ...], torch.Tensor | None, torch.Tensor]] = []
        try:
            decoder.forward = self._recorder(decoder, calls)
            self.decode(*args, **kwargs)
            outputs = self._exchange(calls)
            decoder.forward = self._replayer(calls, outputs)
            return self.decode(*args, **kwargs)
        finally:
            decoder.__dict__.pop("forward", None)

    def _recorder(self, decoder: torch.nn.Module, calls: list) -> Any:
        forward = type(decoder).forward.__get__(decoder)
        tile = [-1]

        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            cache = kwargs.get("feat_cache")
            if cache is None or all(entry is None for entry in cache):  # a tile's first call (or its only one)
                tile[0] += 1
            owner = tile[0] % len(self.ranks)
            if owner == self.index:
                out = forward(*args, **kwargs)
                # a contiguous copy: the loop blends into out in place, and a broadcast sends the storage as laid out
                calls.append((owner, _shape_of(args), out.clone(memory_format=torch.contiguous_format), out))
                return out
            out = self._meta_decoder(decoder)(*_to_meta(args), **_to_meta(kwargs))
            calls.append((owner, _shape_of(args), None, out))
            first = next(a for a in args if isinstance(a, torch.Tensor))
            return torch.empty(out.shape, dtype=out.dtype, device=first.device)

        return record

    def _meta_decoder(self, decoder: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``decoder`` on the meta device (its tensors never copied), for output shapes."""
        if self._meta is None:
            memo = {id(t): torch.empty_like(t, device="meta") for t in (*decoder.parameters(), *decoder.buffers())}
            memo |= {id(p): torch.nn.Parameter(memo[id(p)], requires_grad=False) for p in decoder.parameters()}
            self._meta = copy.deepcopy(decoder, memo)
            self._meta.__dict__.pop("forward", None)
        return self._meta

    def _exchange(self, calls: list) -> list[torch.Tensor]:
        outputs = []
        device = next(self.vae.parameters()).device
        for owner, _, out, like in calls:  # every rank knows every output's shape from the first run
            buffer = out if out is not None else torch.empty(like.shape, dtype=like.dtype, device=device)
            dist.broadcast(buffer, src=self.ranks[owner], group=self.group)
            outputs.append(buffer)
        return outputs

    @staticmethod
    def _replayer(calls: list, outputs: list[torch.Tensor]) -> Any:
        position = [0]

        def replay(*args: Any, **kwargs: Any) -> torch.Tensor:
            i = position[0]
            if i >= len(calls) or calls[i][1] != _shape_of(args):
                raise RuntimeError("the VAE's tiled decode called its decoder differently on the second run; "
                                   "vae_patch cannot replay it")
            position[0] += 1
            return outputs[i].clone()

        return replay


def _shape_of(args: tuple) -> tuple[int, ...]:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tuple(first.shape) if first is not None else ()


def _to_meta(value: Any) -> Any:
    """``value`` with its tensors on the meta device. A list of tensors and Nones is a decoder's feature cache,
    which the decoder writes into: it keeps its identity, its entries replaced."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, list) and all(entry is None or isinstance(entry, torch.Tensor) for entry in value):
        for k, entry in enumerate(value):
            if entry is not None:
                value[k] = entry.to("meta")
        return value
    if isinstance(value, tuple):
        return tuple(_to_meta(v) for v in value)
    return value
