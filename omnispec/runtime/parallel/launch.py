"""The launch of a parallel run: torchrun's environment checked before any rendezvous, and the rendezvous bounded in
time.

``torch.distributed``'s own ``env://`` rendezvous reads the variables as it goes (a missing ``MASTER_ADDR`` is its
traceback) and then waits for the other ranks as long as its process group's timeout (30 minutes), so a shell that
kept ``RANK`` and ``WORLD_SIZE`` from an earlier launch would hang a run that has no other ranks. Here the
variables are read first, and the store the ranks meet at is made with a timeout of its own (``RENDEZVOUS_SECONDS``):
ranks that a launcher starts together meet within seconds. The process group then runs on that store with torch's
usual timeout for its collectives.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ...spec.errors import LaunchError

# How long a rank waits for the others to reach the rendezvous (rank 0 for every rank, the others for rank 0).
RENDEZVOUS_SECONDS = 30.0
WHERE = "policies.parallel"


@dataclass(frozen=True)
class Launch:
    """Where this rank meets the others, as torchrun's environment says."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): every rank is its client


def environment_integer(name: str, default: int) -> int:
    """The integer an environment variable holds (``default`` when unset); ``SpecError`` naming it otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError.single(f"the environment variable {name} is {value!r}, not an integer", WHERE) from None


def launch_environment(world: int) -> Launch:
    """torchrun's variables for a run of ``world`` processes, each present and in range, or one ``SpecError`` naming
    what is missing or wrong (a shell may hold RANK and WORLD_SIZE from another launch)."""
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    if missing:
        raise LaunchError.single(f"WORLD_SIZE is {world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                               f" not set: launch with torchrun --nproc-per-node {world} -m omnispec run ..., which "
                               "sets them all (or unset WORLD_SIZE and RANK left from another launch)", WHERE)
    rank, port = environment_integer("RANK", 0), environment_integer("MASTER_PORT", 0)  # both set (checked above)
    if not 0 <= rank < world:
        raise LaunchError.single(f"RANK is {rank}, outside the {world} ranks (0 to {world - 1}) WORLD_SIZE gives", WHERE)
    if not 0 < port < 1 << 16:
        raise LaunchError.single(f"MASTER_PORT is {port}, not a TCP port (1 to 65535)", WHERE)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return Launch(rank, world, os.environ["MASTER_ADDR"].strip(), port, agent)


def rendezvous(launch: Launch) -> dist.Store:
    """The store every rank meets at, reached within ``RENDEZVOUS_SECONDS`` (rank 0 hosts it and waits for the
    others, unless torchrun's agent hosts it), its timeout then torch's default for the process group's use."""
    hosting = launch.rank == 0 and not launch.agent_store
    deadline = time.monotonic() + RENDEZVOUS_SECONDS
    if not hosting:
        _wait_for_host(launch, deadline)
    seconds = max(deadline - time.monotonic(), 1.0)
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=hosting,
                              timeout=timedelta(seconds=seconds), multi_tenant=True, wait_for_workers=True)
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError / DistNetworkError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        waited = "the other ranks did not come" if hosting else "the rendezvous did not answer"
        raise LaunchError.single(f"rank {launch.rank} of {launch.world_size}: {waited} within {RENDEZVOUS_SECONDS:g} s "
                               f"at {launch.master_addr}:{launch.master_port} ({first}); start every rank together "
                               "(torchrun does), or unset WORLD_SIZE and RANK left from another launch",
                               WHERE) from None
    store.set_timeout(default_pg_timeout)
    return store


def _wait_for_host(launch: Launch, deadline: float) -> None:
    """Until ``deadline``, try to reach the store's host with a plain socket: torch's client would log a page of
    C++ warnings for each failed try before its own error."""
    while True:
        try:
            with socket.create_connection((launch.master_addr, launch.master_port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError.single(
                    f"rank {launch.rank} of {launch.world_size}: nothing answers at MASTER_ADDR:MASTER_PORT "
                    f"{launch.master_addr}:{launch.master_port} within {RENDEZVOUS_SECONDS:g} s "
                    f"({exc.strerror or exc}); "
                    "start rank 0 too (torchrun does), or unset WORLD_SIZE and RANK left from another launch",
                    WHERE) from None
            time.sleep(0.2)


__all__ = ["RENDEZVOUS_SECONDS", "Launch", "environment_integer", "launch_environment", "rendezvous"]
