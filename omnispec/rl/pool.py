"""``RolloutPool``: one pipeline per Ray actor; prompts sharded across actors; weights broadcast.

Each actor builds the same spec (``omnispec.build`` inside the actor, on its own device) and answers
``rollout`` calls; the pool splits the prompt list into contiguous shards, runs them concurrently and
concatenates the returned ``Rollout``s in prompt order (group ids renumbered). ``update_weights`` and
``set_lora`` go to every actor, so all of them roll out the same policy version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..runtime.families import Conditioning
from .rollout import Rollout


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("RolloutPool needs Ray: pip install 'omnispec-diffusion[ray]'") from None
    return ray


class _Worker:
    def __init__(self, spec: Any, build_kwargs: Mapping[str, Any]):
        from ..runtime import build
        from .pipeline import RLPipeline

        self.pipe = build(spec, **dict(build_kwargs), pipeline_class=RLPipeline)

    def rollout(self, prompts: list[str], group_size: int, seed: int, sampler: Any, shared_noise: bool,
                request: Mapping[str, Any], offset: int) -> Rollout:
        from .rollout import rollout

        return rollout(self.pipe, prompts, group_size, seed, sampler, shared_noise, sample_offset=offset, **dict(request))

    def update_weights(self, named: list[tuple[str, torch.Tensor]], component: str | None) -> int:
        from .weights import update_weights

        return update_weights(self.pipe, named, component)

    def set_lora(self, name: str, state: dict, scale: float, component: str | None, metadata: dict | None) -> int:
        from .weights import set_lora

        set_lora(self.pipe, name, state, scale, component, metadata)
        return self.pipe.weight_version

    def weight_version(self) -> int:
        return self.pipe.weight_version

    def close(self) -> None:
        """Drop the pipeline and return the device's cache, before the process is killed (``stop_actors``)."""
        self.pipe = None
        release_device_memory()


def release_device_memory() -> None:
    """Collect dropped modules and return the allocator's cache to the device."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stop_actors(ray: Any, workers: list[Any], timeout: float = 60.0) -> None:
    """Stop workers so that their device memory is free on return: each first drops its pipeline and returns its
    memory (``close``, waited for up to ``timeout`` seconds), then is killed. A killed actor's process exits in its own
    time, holding its memory until then, so a pool, engine or trainer started next on the same GPU could find it
    full. A worker that does not answer is killed all the same."""
    try:
        ray.get([w.close.remote() for w in workers], timeout=timeout)
    except Exception:  # noqa: BLE001 - a dead or stuck worker: the kill below ends it
        pass
    for w in workers:
        ray.kill(w)


def concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """One rollout from shards, in order; group ids continue across shards."""
    offset, group_ids = 0, []
    for part in parts:
        group_ids.append(part.group_ids + offset)
        offset += int(part.group_ids.max()) + 1 if len(part.group_ids) else 0

    def cat_cond(conds: list[Conditioning | None]) -> Conditioning | None:
        if conds[0] is None:
            return None
        return Conditioning.cat(conds)  # type: ignore[arg-type]

    first = parts[0]
    import numpy as np

    return Rollout(
        prompts=[p for part in parts for p in part.prompts], group_ids=torch.cat(group_ids),
        seeds=[s for part in parts for s in part.seeds],
        states={k: torch.cat([p.states[k] for p in parts]) for k in first.states},
        log_probs=torch.cat([p.log_probs for p in parts]),
        stream_log_probs={k: torch.cat([p.stream_log_probs[k] for p in parts]) for k in first.stream_log_probs},
        sigmas=torch.cat([p.sigmas for p in parts]),
        timesteps=torch.cat([p.timesteps for p in parts]), step_indices=torch.cat([p.step_indices for p in parts]),
        positive=cat_cond([p.positive for p in parts]), negative=cat_cond([p.negative for p in parts]),
        array=np.concatenate([p.array for p in parts]),
        request=first.request.model_copy(update={"prompts": [p for part in parts for p in part.prompts],
                                                  "seeds": [s for part in parts for s in part.seeds]}),
        sampler=first.sampler, weight_version=first.weight_version,
        extra={"shards": [len(p.prompts) for p in parts]}, policy_version=first.policy_version,
        forward_batch=torch.cat([p.forward_batch for p in parts]) if all(p.forward_batch is not None for p in parts)
        else None,
    )


def start_actors(worker: type, count: int, gpus: float, cpus: float, *args: Any) -> tuple[Any, list[Any]]:
    """Ray (started here unless it runs already) and ``count`` actors of ``worker`` built with ``args``."""
    ray = _require_ray()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(num_gpus=gpus, num_cpus=cpus)(worker)
    return ray, [actor.remote(*args) for _ in range(count)]


class RolloutPool:
    def __init__(self, spec: Any, num_workers: int = 2, *, num_gpus_per_worker: float = 0.0,
                 num_cpus_per_worker: float = 1.0, **build_kwargs: Any):
        self._ray, self.workers = start_actors(_Worker, num_workers, num_gpus_per_worker, num_cpus_per_worker,
                                               str(spec) if isinstance(spec, Path) else spec, build_kwargs)

    def rollout(self, prompts: Sequence[str], group_size: int = 1, seed: int = 0, sampler: Any = None,
                shared_noise: bool = False, **request: Any) -> Rollout:
        """Shard prompts over the actors; each shard knows its offset in the whole batch, so every sample gets
        the seeds, noise and window it would get in one pipeline's rollout of all the prompts."""
        prompts = list(prompts)
        n = len(self.workers)
        bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
        futures = []
        for w, (lo, hi) in zip(self.workers, zip(bounds, bounds[1:])):
            if hi > lo:
                futures.append(w.rollout.remote(prompts[lo:hi], group_size, seed, sampler, shared_noise, request,
                                                lo * group_size))
        return concat_rollouts(self._ray.get(futures))

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], component: str | None = None) -> list[int]:
        payload = [(k, v.detach().cpu()) for k, v in named]
        return self._ray.get([w.update_weights.remote(payload, component) for w in self.workers])

    def set_lora(self, name: str, state: Mapping[str, torch.Tensor], scale: float = 1.0, component: str | None = None,
                 metadata: Mapping[str, Any] | None = None) -> list[int]:
        payload = {k: v.detach().cpu() for k, v in state.items()}
        return self._ray.get([w.set_lora.remote(name, payload, scale, component, dict(metadata or {}) or None)
                              for w in self.workers])

    def weight_versions(self) -> list[int]:
        return self._ray.get([w.weight_version.remote() for w in self.workers])

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the workers, their device memory free on return (``stop_actors``)."""
        stop_actors(self._ray, self.workers, timeout)
        self.workers = []
