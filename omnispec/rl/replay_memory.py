"""How a replay with gradients fits the device: how many samples a forward takes (its micro-batch), and whether every
forward keeps its graph until the trainer's backward or recomputes it there.

A replay with gradients returns log-probs whose graphs the trainer differentiates later, so every forward's saved
activations stay alive until then: micro-batches alone bound a forward's working memory, not what the graphs keep. One
sample's forward of a real video or image model at training sizes keeps gigabytes, so ``log_prob`` measures what the
first forward (of one sample) keeps on the device and plans the rest from the memory free then:

- **keep**: every forward keeps its graph (no extra work), in micro-batches as large as the rest allows;
- **recompute**: each micro-batch keeps only its inputs, and its forward runs again inside the backward (one more
  forward per micro-batch, ``torch.utils.checkpoint``), one micro-batch's activations alive at a time.

A replay never runs out of memory where a micro-batch of one sample, recomputed, fits. Without a device whose memory can
be read (the CPU), or with ``micro_batch`` given, nothing is planned: the rows run as given, keeping their graphs.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    kept or (``recompute``) rebuilt in the backward; ``why`` says what decided it."""

    micro_batch: int | None
    recompute: bool
    why: str


def plan(forwards: int, free_bytes: int, kept_per_sample: int) -> Batching:
    """The batching for ``forwards`` more sample-forwards with gradients, given the bytes free on the device and what
    one sample's forward keeps until the backward. A forward's working memory (what it frees before it returns, and
    its backward's) is taken as large as what it keeps."""
    budget = int(free_bytes * USABLE_SHARE)
    per = max(kept_per_sample, 1)
    said = f"one sample's forward keeps {_gib(kept_per_sample)} for the backward, {_gib(free_bytes)} free"
    room = budget - forwards * per  # what is left once every graph is kept
    if room >= per:
        return Batching(min(forwards, room // per) or 1, False, f"{said}: every graph kept")
    micro = max(1, budget // (2 * per))
    return Batching(micro, True, f"{said}: the {forwards} forwards' graphs would not fit, so each micro-batch of "
                                 f"{micro} is recomputed in the backward")


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


class ReplayBatcher:
    """Hands out a replay's micro-batch sizes: fixed (``micro_batch`` given, or no gradients, or a device whose
    memory can't be read: all of a step's samples); else one sample first, measured, then ``plan``'s sizes."""

    def __init__(self, device: torch.device, grad: bool, micro_batch: int | None, forwards: int):
        self.device, self.forwards = device, forwards
        self.fixed = micro_batch
        self.batching: Batching | None = None
        self.measuring = grad and micro_batch is None and free_bytes(device) is not None
        if not self.measuring:
            self.batching = Batching(micro_batch, False, "as given" if micro_batch else "all of a step's samples")

    @property
    def recompute(self) -> bool:
        return self.batching is not None and self.batching.recompute

    def size(self, left: int) -> int:
        """The next micro-batch's size, ``left`` samples of this step still to run."""
        if self.measuring:
            return 1
        assert self.batching is not None
        return min(left, self.batching.micro_batch or left)

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
            self.batching = plan(self.forwards, free, after - before)
            logger.info(f"replay with gradients: {self.batching.why}")
