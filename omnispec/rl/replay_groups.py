"""Which stored transitions a replay scores together, and the predictions as the rollout's own forwards made them.

A rollout steps all of its request's samples in one forward per step (cut at ``runtime.max_batch`` rows). A replay
groups the samples it was handed by step and runs them in micro-batches that fit the trainer's memory, or replays a
subset (``Rollout.select``). A matrix multiply's kernel, and with it the order it sums a row in, follows the number of
rows it sees, so on a GPU a row can come out different in its last bits at another row count: the replayed log-prob is
then not the stored one exactly (about 1e-4 on an H100 for a video model, BENCHMARKS.md "Replay exactness").

With ``exact``, a replay whose forwards would not see the rollout's row count takes its predictions' values from
forwards without gradients that do (``Rollout.forward_batch`` samples each, a shorter chunk padded with its own rows
repeated: a row's result follows how many rows the kernels see, not what the other rows hold), and only the gradients
from its own micro-batches. That is one more forward per step without gradients, as a compiled replay already runs;
a replay that already runs the rollout's grouping (a whole rollout in one forward per step) runs none. Padding costs
the rollout's forward for each group however few of its samples a replay scores, so a group of less than half the
rollout's forward (``PADDING_BOUND``; 16 samples of a 128-sample rollout would take 8x the forward work) is valued at
its own size, within the last bits, and ``log_prob`` says so once: a trainer that replays micro-batches of a rollout
one ``select`` at a time gets exact ratios by rolling out at that size (``runtime.max_batch``) or by replaying the
whole rollout in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..log import logger
from ..runtime.families import Streams
from ..runtime.plan import Walk
from ..runtime.run import Run


@dataclass(frozen=True)
class Group:
    """The samples (``rows``) a replay scores at window position ``col`` (the rollout's ``k``), all at request step
    ``step`` and made by forwards of ``forward_batch`` samples (0: not recorded)."""

    col: int
    k: int
    step: int
    forward_batch: int
    rows: list[int]


def groups(step_indices: torch.Tensor, forward_batch: torch.Tensor | None, ks: list[int]) -> list[Group]:
    """The replay's groups, in order: per window position, the samples by step and by their forwards' size."""
    out = []
    for col, k in enumerate(ks):
        found: dict[tuple[int, int], list[int]] = {}
        for row in range(step_indices.shape[0]):
            size = 0 if forward_batch is None else int(forward_batch[row])
            found.setdefault((int(step_indices[row, k]), size), []).append(row)
        out.extend(Group(col, k, step, size, rows) for (step, size), rows in found.items())
    return out


PADDING_BOUND = 2  # a group is padded to the rollout's forward only where that is at most this many times its size
_SAID: set[tuple[int, int]] = set()


def affordable(group: Group) -> bool:
    """Whether valuing ``group`` as the rollout's forwards ran costs at most ``PADDING_BOUND`` times its own rows; where
    not, said once per (group size, rollout size)."""
    if group.forward_batch <= PADDING_BOUND * len(group.rows):
        return True
    key = (len(group.rows), group.forward_batch)
    if key not in _SAID:
        _SAID.add(key)
        logger.warning(f"replaying {len(group.rows)} samples of a rollout that stepped {group.forward_batch} per "
                       f"forward: valued by forwards of {len(group.rows)}, equal to the rollout's within the last bits "
                       f"(its own size would take {group.forward_batch / len(group.rows):.1f}x the forward work); for "
                       "an exact ratio, replay the whole rollout in one log_prob call, or roll out with "
                       "runtime.max_batch at the replay's rows")
    return False


def reproduces(samples: int, forward_batch: int, micro_batch: int | None) -> bool:
    """Whether forwards of ``micro_batch`` samples (None: all at once) over a group of ``samples`` see the rows the
    rollout's forwards saw."""
    return samples == forward_batch and (micro_batch is None or micro_batch >= forward_batch)


def as_rolled_out(run: Run, walk: Walk, i: int, group: Group, inputs: Callable[[list[int]], Streams]) -> Streams:
    """The group's predictions from forwards without gradients of ``group.forward_batch`` samples each, as the
    rollout ran them; ``inputs(rows)`` gives the step's input streams for those samples."""
    size, parts = group.forward_batch, []
    with torch.no_grad():
        for start in range(0, len(group.rows), size):
            chunk = group.rows[start:start + size]
            padded = [chunk[n % len(chunk)] for n in range(size)]
            pred = run.prediction(walk, i, inputs(padded), rows=padded)
            parts.append({s: v[:len(chunk)] for s, v in pred.items()})
    return {s: torch.cat([p[s] for p in parts]) for s in parts[0]}


__all__ = ["PADDING_BOUND", "Group", "affordable", "as_rolled_out", "groups", "reproduces"]
