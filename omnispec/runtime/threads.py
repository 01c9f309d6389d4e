"""How many torch threads a run on a CPU device uses.

torch starts as many threads as the machine has cores. On a machine other processes keep busy, threads beyond the
free cores wait for each other at every op: a tiny model's step then takes many times longer than on one thread
(docs/limits.md, "Threads"). ``runtime.threads`` sets the count; unset, omnispec lowers torch's count to the cores the
machine's load leaves free, once per process, unless the user set ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import os

import torch

from ..log import logger

_CHOSEN: list[int] = []  # the count chosen by the first build of the process


def free_cores() -> int:
    """Cores this process may use that other processes leave free: the cores it may run on less the load average
    of the last minute beyond this process's own share (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, round(cores - max(0.0, load - 1.0))))


def cpu_threads(wanted: int | None) -> int:
    """The torch threads a CPU run of this process uses: ``wanted``; else, unset, the count a first build chose (or
    torch's, where ``OMP_NUM_THREADS`` is set); else torch's lowered to ``free_cores``."""
    if wanted is not None:
        return wanted
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    if _CHOSEN:
        return _CHOSEN[0]
    return min(torch.get_num_threads(), free_cores())


def set_cpu_threads(wanted: int | None) -> None:
    """Torch's intra-op threads for a CPU run: ``wanted``, or (unset) torch's count lowered to ``free_cores``."""
    if wanted is not None:
        torch.set_num_threads(wanted)
        return
    if "OMP_NUM_THREADS" in os.environ or _CHOSEN:
        return
    current = torch.get_num_threads()
    chosen = cpu_threads(None)
    _CHOSEN.append(chosen)
    if chosen < current:
        torch.set_num_threads(chosen)
        logger.info(f"CPU: {chosen} torch thread(s) of {current}, the cores the machine's load leaves free "
                    "(runtime.threads or OMP_NUM_THREADS sets it)")
