"""``RolloutEngine``: omnispec as the rollout side of an RL job that a separate trainer process drives.

The engine holds one pipeline per Ray actor (as ``RolloutPool`` does). The trainer

- submits batches of rollout requests (``submit`` returns a ``RolloutHandle`` at once; ``get`` blocks and returns
  the batch's rollouts in request order). Each request goes whole to the worker given the fewest samples so far,
  and queues there while it is busy. A request is not split over workers: the trainer's replay of a rollout then
  runs each step's forward on the same rows the rollout's did, which is what makes the ratio exactly 1 on a CPU
  (a forward of another batch size can differ in the last bit there); a trainer spreads work by sending several
  requests;
- sends weights without a restart: a full state dict (``update_weights``) or a LoRA (``set_lora``), cut into
  buckets of ``bucket_bytes`` (``omnispec.rl.buckets``), each bucket put in Ray's object store once and read by
  every worker. Each update carries a version number (the last one + 1 unless given, and larger than it); every
  rollout records the version it ran at in ``Rollout.policy_version``. An actor runs its calls one at a time in
  the order the trainer made them, and a worker stages buckets aside and applies them in one step after the last
  (``commit``): an update waits for the rollouts submitted before it and applies between rollouts, so a rollout
  never mixes versions;
- frees the device between phases: ``sleep`` moves every worker's weights to the host and empties its caches,
  ``wake`` moves them back. While asleep, ``submit`` refuses with ``EngineAsleep`` (rather than waking on its
  own: a trainer sharing the GPU would not expect the engine to take memory back behind its back); weight
  updates are taken while asleep and land in host memory.

Measurement: ``UpdateReport`` (bytes, buckets, seconds, GB/s) from each update, and ``RolloutHandle.stats``
(samples, seconds, samples/s) from each batch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..spec import SpecError, SpecTypeError
from .buckets import Assembler, Piece, check_bucket_bytes, state_items, to_buckets
from .checks import check_rollout_args
from .pool import release_device_memory, start_actors, stop_actors
from .rollout import Rollout

DEFAULT_BUCKET_BYTES = 256 << 20
_ROLLOUT_KEYS = ("prompts", "group_size", "seed", "sampler", "shared_noise")


class EngineAsleep(RuntimeError):
    """A rollout submitted while the engine sleeps (``engine.wake()`` first)."""


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout call: ``prompts x group_size`` samples; ``options`` are request fields (``steps``,
    ``guidance_scale``, ``height`` ...), as ``Pipeline.rollout`` takes them."""

    prompts: tuple[str, ...]
    group_size: int = 1
    seed: int = 0
    sampler: Any = None
    shared_noise: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: RolloutRequest | Mapping[str, Any], where: str = "request") -> RolloutRequest:
        """A request from itself or a mapping: ``prompts`` (a string or strings), the rollout's arguments, and
        any other key a request field."""
        if isinstance(value, RolloutRequest):
            given = {k: getattr(value, k) for k in _ROLLOUT_KEYS} | {"options": value.options}
        elif isinstance(value, Mapping):
            if "prompts" not in value:
                raise SpecError.single("a rollout request needs 'prompts'", where)
            rest = dict(value)
            given = {k: rest.pop(k) for k in _ROLLOUT_KEYS if k in rest} | {"options": rest}
        else:
            raise SpecTypeError.single(f"expected a rollout request (a mapping or RolloutRequest), got "
                                       f"{type(value).__name__}", where)
        given = {"group_size": 1, "seed": 0, "sampler": None, "shared_noise": False} | given
        try:
            prompts = check_rollout_args(given["prompts"], given["group_size"], given["seed"], given["shared_noise"], 0)
        except (SpecError, SpecTypeError) as exc:
            problem = exc.problems[0]
            raise type(exc).single(problem.message, f"{where}.{problem.path}" if problem.path else where) from None
        return cls(**given | {"prompts": tuple(prompts)})

    @property
    def samples(self) -> int:
        return len(self.prompts) * self.group_size


@dataclass
class UpdateReport:
    """One weight update: the version it carries, what was sent and how long it took (``seconds``: from the call
    to every worker applying it, waiting for rollouts submitted before it included; ``apply_seconds``: the slowest
    worker's commit)."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    apply_seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    @property
    def seconds_per_gb(self) -> float:
        return self.seconds / (self.bytes / 1e9) if self.bytes else 0.0


class _EngineWorker:
    """One pipeline in a Ray actor: rollouts stamped with the applied version, staged buckets, sleep and wake."""

    def __init__(self, spec: Any, build_kwargs: Mapping[str, Any], make_components: Any = None):
        from ..runtime import build
        from .pipeline import RLPipeline

        kwargs = dict(build_kwargs)
        if make_components is not None:
            kwargs["components"] = make_components()
        self.pipe = build(spec, **kwargs, pipeline_class=RLPipeline)
        self.version = 0
        self.staged = Assembler()
        self.complete: dict[str, torch.Tensor] = {}
        self.asleep: dict[str, torch.device] | None = None  # components sleep moved, and their devices
        self.stage_failed = False

    def rollout(self, request: RolloutRequest, index: int) -> tuple[Rollout, float]:
        from .rollout import rollout

        if self.asleep is not None:
            raise EngineAsleep("this worker is asleep")
        start = time.perf_counter()
        ro = rollout(self.pipe, list(request.prompts), request.group_size, request.seed, request.sampler,
                     request.shared_noise, **dict(request.options))
        ro.policy_version = self.version
        ro.extra["worker"] = index
        return ro, time.perf_counter() - start

    def stage(self, bucket: list[Piece]) -> int:
        try:
            done = self.staged.add(bucket)
        except Exception:
            self.stage_failed = True  # the commit then refuses: nothing of this update is applied
            raise
        self.complete.update(done)
        return len(done)

    def commit(self, version: int, kind: str, lora: Mapping[str, Any] | None, component: str | None) -> float:
        """Apply the staged tensors as one update (``full``: into the parameters; ``lora``: as adapter
        ``lora["name"]``), then take ``version``. Staged pieces are dropped whatever happens."""
        from .weights import set_lora, update_weights

        start = time.perf_counter()
        state, missing, failed = self.complete, self.staged.incomplete(), self.stage_failed
        self.complete, self.staged, self.stage_failed = {}, Assembler(), False
        if failed:
            raise SpecError.single("a bucket of this update could not be staged; nothing was applied", "buckets")
        if missing:
            raise SpecError.single(f"tensors sent in part: {', '.join(missing[:5])}", "buckets")
        if kind == "full":
            update_weights(self.pipe, list(state.items()), component)
        else:
            assert lora is not None
            set_lora(self.pipe, lora["name"], state, lora["scale"], component, lora["metadata"])
        self.version = version
        return time.perf_counter() - start

    def sleep(self) -> dict[str, int]:
        """Each component whose weights all lie on one device moves to the host (its tensors keep their identity,
        so references and hooks stay); components spread over several devices (an offload policy's) are left as
        they are. Prompt encodings and the allocator's cache are emptied. Returns device bytes before and after."""
        if self.asleep is not None:
            return {"moved_bytes": 0, **_allocated()}
        before = _allocated()["allocated_bytes"]
        moved, nbytes = {}, 0
        for name, tensors in _component_tensors(self.pipe).items():
            devices = {t.device for t in tensors}
            if len(devices) == 1 and next(iter(devices)).type != "cpu":
                moved[name] = next(iter(devices))
                nbytes += sum(t.numel() * t.element_size() for t in tensors)
                _move(tensors, torch.device("cpu"))
        self.asleep = moved
        self.pipe._encodings.clear()  # prompt encodings live on the device
        release_device_memory()
        return {"moved_bytes": nbytes, "allocated_before": before, **_allocated()}

    def wake(self) -> dict[str, int]:
        """Each component moved by ``sleep`` back to its device, tensors added meanwhile (a LoRA set while
        asleep) included."""
        if self.asleep is None:
            return {"moved_bytes": 0, **_allocated()}
        nbytes = 0
        tensors = _component_tensors(self.pipe)
        for name, device in self.asleep.items():
            _move(tensors[name], device)
            nbytes += sum(t.numel() * t.element_size() for t in tensors[name])
        self.asleep = None
        return {"moved_bytes": nbytes, **_allocated()}

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "asleep": self.asleep is not None, "weight_version": self.pipe.weight_version}

    def close(self) -> dict[str, int]:
        """Drop the pipeline and the staged weights and return the device's cache, before the process is killed:
        a killed actor's process exits in its own time, holding its device memory until then."""
        self.pipe = self.staged = None
        self.complete = {}
        release_device_memory()
        return _allocated()


def _component_tensors(pipe: Any) -> dict[str, list[torch.Tensor]]:
    """Each module component's parameters and buffers, once each."""
    found = {}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            unique = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
            found[name] = list(unique.values())
    return found


def _move(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Move tensors in place (``.data``): modules, optimizers and compiled graphs keep the same objects."""
    with torch.no_grad():
        for tensor in tensors:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)


def _ray_get(ray: Any, refs: Any, timeout: float | None = None) -> Any:
    """``ray.get``, raising a worker's own argument errors (``SpecError``, ``SpecTypeError``, ``EngineAsleep``) as
    they are, without Ray's wrapping traceback; anything else keeps it."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (SpecError, SpecTypeError)):  # made again from its problems: a pickled one's
            raise type(cause)(cause.problems) from None   # message is not restored (its args are its text)
        if isinstance(cause, EngineAsleep):
            raise cause from None
        raise


def _allocated() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {"allocated_bytes": 0, "reserved_bytes": 0}
    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}


class RolloutHandle:
    """A submitted batch: ``done()`` without waiting, ``result()`` (or ``engine.get(handle)``) blocks for the
    rollouts, in request order. ``stats`` once collected: samples, seconds from submit to result, samples/s, and
    the workers' own rollout seconds summed."""

    def __init__(self, ray: Any, requests: list[RolloutRequest], refs: list[Any]):
        self._ray, self.requests, self._refs = ray, requests, refs
        self.submitted = time.perf_counter()
        self._result: list[Rollout] | None = None
        self.stats: dict[str, float] = {}

    def done(self) -> bool:
        ready, _ = self._ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self, timeout: float | None = None) -> list[Rollout]:
        if self._result is None:
            answers = _ray_get(self._ray, self._refs, timeout)
            seconds = time.perf_counter() - self.submitted
            samples = sum(r.samples for r in self.requests)
            self.stats = {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                          "worker_seconds": sum(s for _, s in answers)}
            self._result = [ro for ro, _ in answers]
        return self._result


class RolloutEngine:
    """Rollout workers a trainer drives: ``submit``/``get``, versioned weight updates in buckets, ``sleep``/``wake``.

    ``spec`` and ``build_kwargs`` are what each worker passes to ``omnispec.build``; ``make_components`` (a
    picklable callable, optional) makes the ``components`` inside each worker (random weights, a trainer's own
    modules). Ray is started if it is not (the ``ray`` extra)."""

    def __init__(self, spec: Any, num_workers: int = 2, *, num_gpus_per_worker: float = 0.0,
                 num_cpus_per_worker: float = 1.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 make_components: Any = None, **build_kwargs: Any):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise SpecError.single(f"expected an int >= 1, got {num_workers!r}", "num_workers")
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._ray, self.workers = start_actors(_EngineWorker, num_workers, num_gpus_per_worker, num_cpus_per_worker,
                                               str(spec) if isinstance(spec, Path) else spec, build_kwargs,
                                               make_components)
        self._load = [0] * num_workers  # samples given to each worker so far
        self._lock = threading.Lock()
        self.version = 0
        self.asleep = False
        self._ray.get([w.state.remote() for w in self.workers])  # built (a build error raises here)

    # ---- rollouts -------------------------------------------------------------------------------------

    def submit(self, requests: Iterable[RolloutRequest | Mapping[str, Any]]) -> RolloutHandle:
        """Queue a batch of rollout requests; returns at once. Requests are checked here (prompts, group size,
        seed); the rest (sampler, request fields) in the worker, raised by ``get``."""
        if isinstance(requests, (Mapping, RolloutRequest)):
            requests = [requests]
        checked = [RolloutRequest.of(r, f"requests.{i}") for i, r in enumerate(requests)]
        if not checked:
            raise SpecError.single("an empty batch", "requests")
        with self._lock:
            self._check_awake()
            refs = [self._place(request) for request in checked]
        return RolloutHandle(self._ray, checked, refs)

    def get(self, handle: RolloutHandle, timeout: float | None = None) -> list[Rollout]:
        """The batch's rollouts in request order (blocks)."""
        if not isinstance(handle, RolloutHandle):
            raise SpecTypeError.single(f"expected a RolloutHandle (from submit), got {type(handle).__name__}",
                                       "handle")
        return handle.result(timeout)

    def rollout(self, requests: Iterable[RolloutRequest | Mapping[str, Any]]) -> list[Rollout]:
        return self.get(self.submit(requests))

    def _place(self, request: RolloutRequest) -> Any:
        """The request, whole, to the worker given the fewest samples so far."""
        worker = min(range(len(self.workers)), key=lambda i: self._load[i])
        self._load[worker] += request.samples
        return self.workers[worker].rollout.remote(request, worker)

    def _check_awake(self) -> None:
        if self.asleep:
            raise EngineAsleep("the rollout engine is asleep: call engine.wake() before submitting rollouts")

    # ---- weights --------------------------------------------------------------------------------------

    def update_weights(self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int | None = None, component: str | None = None,
                       bucket_bytes: int | None = None) -> UpdateReport:
        """Copy a full (or partial) state dict of the denoiser (or ``component``) into every worker, in buckets;
        the workers take ``version`` (default: the last + 1) once every tensor arrived and was applied."""
        return self._send(state_items(state), "full", None, version, component, bucket_bytes)

    def set_lora(self, name: str, state: Mapping[str, torch.Tensor], scale: float = 1.0, *,
                 metadata: Mapping[str, Any] | None = None, version: int | None = None, component: str | None = None,
                 bucket_bytes: int | None = None) -> UpdateReport:
        """Add or replace LoRA adapter ``name`` in every worker (``omnispec.rl.set_lora``), sent in buckets."""
        if not isinstance(name, str) or not name:
            raise SpecError.single(f"expected an adapter name, got {name!r}", "name")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise SpecTypeError.single(f"expected a mapping (the LoRA config), got {type(metadata).__name__}",
                                       "metadata")
        lora = {"name": name, "scale": scale, "metadata": dict(metadata) if metadata else None}
        return self._send(state_items(state), "lora", lora, version, component, bucket_bytes)

    def _send(self, pairs: list[tuple[str, torch.Tensor]], kind: str, lora: dict | None, version: int | None,
              component: str | None, bucket_bytes: int | None) -> UpdateReport:
        if not pairs:
            raise SpecError.single("the state dict is empty", "state")
        size = self.bucket_bytes if bucket_bytes is None else check_bucket_bytes(bucket_bytes)
        with self._lock:
            if version is None:
                version = self.version + 1
            if isinstance(version, bool) or not isinstance(version, int) or version <= self.version:
                raise SpecError.single(f"expected an int larger than the current version {self.version}, got "
                                       f"{version!r}", "version")
            start = time.perf_counter()
            nbytes, buckets, staged = 0, 0, []
            for bucket in to_buckets(pairs, size):
                ref = self._ray.put(bucket)  # once in the object store, read by every worker
                staged += [w.stage.remote(ref) for w in self.workers]
                nbytes += sum(p.nbytes for p in bucket)
                buckets += 1
            commits = [w.commit.remote(version, kind, lora, component) for w in self.workers]
            _ray_get(self._ray, staged)
            apply_s = max(_ray_get(self._ray, commits))
            self.version = version
            return UpdateReport(version, len(pairs), nbytes, buckets, time.perf_counter() - start, apply_s)

    # ---- device memory --------------------------------------------------------------------------------

    def sleep(self) -> list[dict[str, int]]:
        """Move every worker's weights to the host and free its device caches, after the rollouts already
        submitted; rollouts are refused until ``wake``. Returns each worker's device bytes."""
        with self._lock:
            self.asleep = True
            return self._ray.get([w.sleep.remote() for w in self.workers])

    def wake(self) -> list[dict[str, int]]:
        """Move the weights back to the devices they came from."""
        with self._lock:
            answers = self._ray.get([w.wake.remote() for w in self.workers])
            self.asleep = False
            return answers

    def worker_states(self) -> list[dict[str, Any]]:
        return self._ray.get([w.state.remote() for w in self.workers])

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the workers, their device memory free on return (``stop_actors``: each drops its pipeline and returns
        its memory before the kill), so that an engine or trainer started next on the same GPU finds it free."""
        stop_actors(self._ray, self.workers, timeout)
        self.workers = []
