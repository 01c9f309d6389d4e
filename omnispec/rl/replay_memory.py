"""How a replay with gradients fits the device: how many samples a forward takes (its micro-batch), and whether every
forward keeps its graph until the trainer's backward, recomputes it there, or keeps only its blocks' inputs.

A replay with gradients returns log-probs whose graphs the trainer differentiates later, so every forward's saved
activations stay alive until then: micro-batches alone bound a forward's working memory, not what the graphs keep. One
sample's forward of a real video or image model at training sizes keeps gigabytes (a 19B video model's, more than an
80 GB card has left beside its weights), so before the first forward ``log_prob`` probes one sample's: it runs once
with every tensor its graph would save counted and dropped (``SavedBytes``), and the rest is planned from that and the
memory free:

- **keep**: every forward keeps its graph (no extra work), in micro-batches as large as the rest allows;
- **recompute**: each micro-batch keeps only its inputs, and its forward runs again inside the backward (one more
  forward per micro-batch, ``torch.utils.checkpoint``), one micro-batch's activations alive at a time;
- **blocks**: where not even one sample's whole forward fits recomputed, the denoiser checkpoints block by block
  (diffusers' ``enable_gradient_checkpointing``, switched on for the replay's forwards and their recomputation only):
  a forward keeps its blocks' inputs, and the backward recomputes one block at a time. What that keeps is measured on
  the first real forward, and the rest planned from it as above.

Each mode runs the same kernels forward, so the log-probs and gradients are the same. Without a device whose memory can
be read (the CPU), or with ``micro_batch`` given, nothing is planned: the rows run as given, keeping their graphs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..log import logger

# The share of the free memory a plan may use: the allocator's fragmentation and the backward's own buffers (the
# gradients of the weights it reaches) need the rest.
USABLE_SHARE = 0.85


@dataclass(frozen=True)
class Batching:
    """How a replay's forwards run: ``micro_batch`` samples each (None: all of a step's samples at once), each graph
    kept or (``recompute``) rebuilt in the backward, with the denoiser checkpointing its ``blocks`` or not; ``why``
    says what decided it."""

    micro_batch: int | None
    recompute: bool
    why: str
    blocks: bool = False


def plan(forwards: int, free_bytes: int, kept_per_sample: int, why_blocks: str = "") -> Batching:
    """The batching for ``forwards`` more sample-forwards with gradients, given the bytes free on the device and what
    one sample's forward keeps until the backward. A forward's working memory (what it frees before it returns, and
    its backward's) is taken as large as what it keeps. ``why_blocks``: why the denoiser checkpoints its blocks
    (empty: it doesn't)."""
    budget = int(free_bytes * USABLE_SHARE)
    per = max(kept_per_sample, 1)
    said = f"{why_blocks}one sample's forward keeps {_gib(kept_per_sample)} for the backward, {_gib(free_bytes)} free"
    blocks = bool(why_blocks)
    room = budget - forwards * per  # what is left once every graph is kept
    if room >= per:
        return Batching(min(forwards, room // per) or 1, False, f"{said}: every graph kept", blocks)
    micro = max(1, budget // (2 * per))
    return Batching(micro, True, f"{said}: the {forwards} forwards' graphs would not fit, so each micro-batch of "
                                 f"{micro} is recomputed in the backward", blocks)


def fits_recomputed(free_bytes: int, kept_per_sample: int) -> bool:
    """Whether one sample's forward fits recomputed in the backward: what it keeps and its working memory."""
    return 2 * kept_per_sample <= int(free_bytes * USABLE_SHARE)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def free_bytes(device: torch.device) -> int | None:
    """Bytes a replay may still allocate on ``device``: the driver's free memory plus what torch's allocator holds
    unused; None where it can't be read (the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class SavedBytes:
    """The bytes a forward's graph would keep on ``device``, keeping none of them: a ``saved_tensors_hooks`` pair that
    counts each saved tensor's storage once (parameters and buffers, which stay anyway, not at all) and drops it.
    The graph it leaves can't be differentiated; a probe runs for its count alone."""

    def __init__(self, device: torch.device, modules: Iterable[torch.nn.Module]):
        self.device_type, self.bytes = device.type, 0  # a pipeline's "cuda" is its tensors' "cuda:0"
        self.resident = {_storage(t)[0] for m in modules if isinstance(m, torch.nn.Module)
                         for t in (*m.parameters(), *m.buffers())}
        self.seen: dict[int, weakref.ref] = {}  # storage address -> a tensor saved from it, while it lives

    def pack(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return None
        address, nbytes = _storage(tensor)
        earlier = self.seen.get(address)
        if address is not None and address not in self.resident and (earlier is None or earlier() is None):
            self.bytes += nbytes
            self.seen[address] = weakref.ref(tensor)
        return None

    @staticmethod
    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("a memory probe's graph is never differentiated")

    def counting(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _storage(tensor: torch.Tensor) -> tuple[int | None, int]:
    """A tensor's storage address and size; (None, 0) for a tensor subclass without one (a quantized weight)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0
    return storage.data_ptr(), storage.nbytes()


def checkpoints_blocks(denoiser: torch.nn.Module) -> bool:
    """Whether ``denoiser`` can checkpoint its blocks: a diffusers model whose ``enable_gradient_checkpointing`` takes
    (it raises ``ValueError`` where the class does not support it), asked through that public call and undone."""
    if not hasattr(denoiser, "enable_gradient_checkpointing"):
        return False
    if getattr(denoiser, "is_gradient_checkpointing", False):
        return True
    try:
        denoiser.enable_gradient_checkpointing()
    except ValueError:
        return False
    denoiser.disable_gradient_checkpointing()
    return True


@contextmanager
def blocks_checkpointed(denoiser: torch.nn.Module, on: bool) -> Iterator[None]:
    """``denoiser`` checkpointing its blocks inside (when ``on``), as it was after: around a replay's forward, which
    runs again inside the backward, so the recomputation checkpoints as the forward did."""
    switch = on and not getattr(denoiser, "is_gradient_checkpointing", False)
    if switch:
        denoiser.enable_gradient_checkpointing()
    try:
        yield
    finally:
        if switch:
            denoiser.disable_gradient_checkpointing()


class ReplayBatcher:
    """Hands out a replay's micro-batch sizes: fixed (``micro_batch`` given, or no gradients, or a device whose
    memory can't be read: all of a step's samples); else one sample first, probed (``probe``) and, where its whole
    graph would not fit, measured with the blocks checkpointed, then ``plan``'s sizes."""

    def __init__(self, device: torch.device, grad: bool, micro_batch: int | None, forwards: int):
        self.device, self.forwards = device, forwards
        self.fixed = micro_batch
        self.batching: Batching | None = None
        self.probing = grad and micro_batch is None and free_bytes(device) is not None
        self.measuring = False
        self.why_blocks = ""
        if not self.probing:
            self.batching = Batching(micro_batch, False, "as given" if micro_batch else "all of a step's samples")

    @property
    def recompute(self) -> bool:
        return self.batching is not None and self.batching.recompute

    @property
    def blocks(self) -> bool:
        return bool(self.why_blocks)

    def size(self, left: int) -> int:
        """The next micro-batch's size, ``left`` samples of this step still to run."""
        if self.probing or self.measuring:
            return 1
        assert self.batching is not None
        return min(left, self.batching.micro_batch or left)

    def probe(self, forward: Callable[[], object], modules: Iterable[torch.nn.Module], denoiser: torch.nn.Module
              ) -> None:
        """Count what one sample's ``forward`` (with gradients) would keep, keeping nothing, and plan from it; where
        not even that sample fits recomputed and ``denoiser`` checkpoints its blocks, the first real forward runs so
        and is measured instead."""
        counter = SavedBytes(self.device, modules)
        with torch.enable_grad(), counter.counting():
            forward()
        self.probing = False
        free = free_bytes(self.device)
        assert free is not None
        if fits_recomputed(free, counter.bytes) or not checkpoints_blocks(denoiser):
            self.batching = plan(self.forwards, free, counter.bytes)
            logger.info(f"replay with gradients: {self.batching.why}")
            return
        self.why_blocks = (f"one sample's whole forward would keep {_gib(counter.bytes)}, which does not fit "
                           f"recomputed in {_gib(free)} free, so the denoiser checkpoints its blocks; ")
        self.measuring = True

    @contextmanager
    def forward(self, samples: int) -> Iterator[None]:
        """Around one micro-batch's forward (and its log-prob): the first, while measuring, is measured and the
        rest planned from it."""
        before = allocated(self.device) if self.measuring else None
        yield
        self.forwards -= samples
        if before is not None:
            after = allocated(self.device)
            assert after is not None
            self.measuring = False
            free = free_bytes(self.device)
            assert free is not None
            self.batching = plan(self.forwards, free, after - before, self.why_blocks)
            logger.info(f"replay with gradients: {self.batching.why}")
