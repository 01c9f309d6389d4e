"""Logging: the ``omnispec`` logger, and how the CLI sets verbosity for itself and the libraries it drives.

As a library omnispec only logs (to ``logging.getLogger("omnispec")``) and leaves handlers and the other
libraries' settings to the application. The CLI calls ``configure``: omnispec's progress lines on stderr, and for
``-q``/``-v`` the verbosity of diffusers, transformers and huggingface_hub through their own environment variables
(``DIFFUSERS_VERBOSITY``, ``TRANSFORMERS_VERBOSITY``, ``HF_HUB_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``),
each only when the user has not set it: without a flag their defaults (and the user's settings) stand.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("omnispec")
logger.addHandler(logging.NullHandler())

# Loggers of dependencies that report their own internals on import (torchao's optional kernels, torch's pytree
# registrations, dynamo's recompiles): nothing a user of the CLI can act on; shown with -v.
_INTERNAL = ("torchao", "torch.utils._pytree", "torch._dynamo", "torch._inductor")
_VERBOSITY_VARIABLES = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY",
                        "huggingface_hub": "HF_HUB_VERBOSITY"}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirected stream)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(verbosity: int = 0) -> None:
    """Set up logging for the CLI: ``verbosity`` -1 (``-q``: warnings and errors, no progress), 0 (progress lines
    and bars), 1 (``-v``: the libraries' info messages too), 2 (``-vv``: debug)."""
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if verbosity < 0 else logging.INFO if verbosity < 2 else logging.DEBUG)
    logger.propagate = False
    if verbosity <= 0:
        for name in _INTERNAL:
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notes meant for library authors
    if verbosity == 0:
        return
    level = "error" if verbosity < 0 else "info" if verbosity == 1 else "debug"
    for package, variable in _VERBOSITY_VARIABLES.items():
        if variable in os.environ:
            continue  # the user's own setting
        os.environ[variable] = level  # read when the library is first imported
        if package in sys.modules:
            module = __import__(f"{package}.utils.logging" if package != "huggingface_hub" else
                                "huggingface_hub.utils.logging", fromlist=["set_verbosity"])
            module.set_verbosity(getattr(logging, level.upper()))
    if verbosity < 0:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def progress_bars_disabled() -> bool:
    """Whether the user turned progress bars off (``-q``, or ``HF_HUB_DISABLE_PROGRESS_BARS``): then diffusers'
    loading bars and omnispec's own go too."""
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on")


@contextmanager
def timed(message: str, level: int = logging.INFO) -> Iterator[None]:
    """Log ``message ...`` when the work starts and ``message: N s`` when it ends."""
    if not logger.isEnabledFor(level):
        yield
        return
    logger.log(level, f"{message} ...")
    start = time.perf_counter()
    yield
    logger.log(level, f"{message}: {time.perf_counter() - start:.1f} s")


__all__ = ["configure", "logger", "progress_bars_disabled", "timed"]
