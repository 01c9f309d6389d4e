"""Processes for tests, forked from one that has imported torch, diffusers, transformers and omnispec already.

A test that runs ``python -m omnispec run ...`` as ranks of a parallel run, or a benchmark's ``--smoke``, spent most
of its seconds importing those libraries again in every process (about 6 s each on a CI core). Here a forkserver
(``multiprocessing``'s) imports them once; each process the tests ask for is a fork of it, with its own environment,
working folder, arguments and output files, running the module as ``python -m`` would (``runpy``). It is a process
of its own, so what it changes (torch's threads, dynamo's caches, hooks, the logger) ends with it.

Not for tests about what a fresh interpreter prints or imports (the first-contact and import-time tests): a fork
starts with the libraries imported and their import-time messages already printed in the server.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PRELOAD = ["torch", "diffusers", "transformers", "omnispec.runtime.build", "omnispec.cli"]
_context: multiprocessing.context.BaseContext | None = None


def _server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(module: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the fork: this environment, folder and output files, then the module as ``__main__``."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    with open(out, "w") as stdout, open(err, "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
    sys.stdin = open(os.devnull)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # read at torch's import, in the server
    sys.argv = [module, *argv]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if isinstance(code, str):
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code or 0)


def start(module: str, argv: list[str], env: dict[str, str], folder: Path, name: str, cwd: Path | None = None
          ) -> tuple[object, Path, Path]:
    """Start ``python -m module argv`` as a fork in ``cwd`` (default: ``folder``); its output goes to
    ``folder/name.out`` and ``folder/name.err``."""
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    process = _server().Process(target=_child, args=(module, argv, env, str(cwd or folder), str(out), str(err)))
    process.start()
    return process, out, err


def finish(process, out: Path, err: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started process (killed past ``timeout``) and read what it printed."""
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text())
    return subprocess.CompletedProcess(args, process.exitcode, out.read_text(), err.read_text())


def run(module: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 900
        ) -> subprocess.CompletedProcess:
    """``python -m module argv`` in ``cwd`` with ``env``, as a fork of the preloaded server."""
    process, out, err = start(module, argv, env, cwd, "process")
    return finish(process, out, err, [module, *argv], timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, module: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 900
              ) -> list[subprocess.CompletedProcess]:
    """``nproc`` ranks of ``python -m module argv`` with the environment torchrun gives its workers (env://
    rendezvous on a free port, no agent store), each a fork of the preloaded server. A rank still running 20 s after
    another failed, or past ``timeout``, is stopped (its exit code then negative: killed)."""
    port = str(free_port())
    started = []
    for rank in range(nproc):
        ranked = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
                  "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
        started.append(start(module, argv, ranked, cwd, f"rank{rank}"))
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(process.exitcode is None for process, _, _ in started):
            now = time.monotonic()
            if failed_at is None and any(process.exitcode for process, _, _ in started):
                failed_at = now  # the others may wait for it at a collective: a few seconds to say so, then stopped
            if now > deadline or (failed_at is not None and now > failed_at + 20):
                break
            time.sleep(0.05)
    finally:
        for process, _, _ in started:
            if process.exitcode is None:
                process.kill()
            process.join()
    return [subprocess.CompletedProcess([module, *argv], process.exitcode, out.read_text(), err.read_text())
            for process, out, err in started]


def python_m(command: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 900, capture_output: bool = True, text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, ...)`` as a fork of
    the preloaded server: the same exit code and output, without importing the libraries again."""
    assert command[:2] == [sys.executable, "-m"] and capture_output and text, command
    with tempfile.TemporaryDirectory() as folder:
        process, out, err = start(command[2], [str(a) for a in command[3:]], dict(os.environ if env is None else env),
                                  Path(folder), "process", cwd=Path(cwd or os.getcwd()))
        return finish(process, out, err, command, timeout)
