"""The Hugging Face Hub as a source of checkpoints and LoRAs: whether a reference is a Hub id, whether the Hub can be
reached, and small files from the cache or the Hub.

A Hub id without a network would otherwise retry downloads for minutes; every caller asks ``check_reachable``
first, which answers at once (one request per process) and names the way out.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import SpecError
from .files import path_kind, user_path


def hub_offline() -> bool:
    return _true(os.environ.get("HF_HUB_OFFLINE"))


def _true(value: str | None) -> bool:
    return (value or "0").strip().lower() in ("1", "true", "yes", "on")


# One part of a Hub repository id (its owner, its name): letters, digits, '-', '_' and '.', neither first nor last a
# '-' or '.', no '--' or '..', at most 96 characters. huggingface_hub refuses any other with a traceback's ValueError.
_HUB_NAME = re.compile(r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def is_hub_id(ref: str) -> bool:
    """``owner/name`` that names nothing on disk, each part a name the Hub allows."""
    return path_kind(user_path(ref)) is None and ref.count("/") == 1 and all(
        _HUB_NAME.fullmatch(part) for part in ref.split("/"))


def hub_path_problem(path: str) -> str | None:
    """What makes ``path`` no file path inside a repository (an empty, ``.`` or ``..`` part, a backslash), or None:
    a reference to a Hub file, or to a file inside a component's folder, stays inside it."""
    parts = path.split("/")
    if "\\" in path or any(part in ("", ".", "..") for part in parts):
        return (f"{path!r}: not a path inside a repository or folder (a part is empty, '.' or "
                "'..', or holds a backslash); a path of your own starts with /, ./ or ../")
    return None


@functools.cache
def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hub endpoint can't be reached (one quick request, once per process), or None when it answers."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any transport error means the same here
        return f"{constants.ENDPOINT}: {str(exc).strip() or type(exc).__name__}"
    return None


LOCAL_CHECKPOINT = "a local checkpoint directory with --source (source= in Python)"


def needs_hub(spec: Any, source: str | None = None) -> bool:
    """Whether running ``spec`` (from ``source`` when given) may read anything from the Hub: a checkpoint, a
    component, a weights file or a LoRA that is not on this machine."""
    def local(ref: str | None) -> bool:
        return ref is None or path_kind(user_path(ref)) is not None

    root = source or spec.model.source
    for component in spec.model.components.values():
        folder = component.source or root
        if not local(folder) or (component.file is not None and not local(component.file) and folder is None):
            return True
    return not local(root) or any(not local(a.path) for a in spec.model.adapters.values())


def offline_unless_needed(spec: Any, source: str | None = None, *, downloads: bool = True) -> None:
    """Put huggingface_hub (and the libraries that ask it) in offline mode for this process when ``spec`` needs
    nothing from the Hub and the user has not said otherwise: a local run then makes no request (libraries ask the
    Hub on their own: an agent registry, a kernel's trust status), which on a machine without a network waits for
    timeouts and, at ``-vv``, prints their tracebacks. ``downloads=False``: the caller reads only what is on disk
    (the Hub's cache included), so the process goes offline whatever the spec names."""
    if _may_go_offline(spec, source, downloads):
        _set_offline(True)


@contextmanager
def offline_while_local(spec: Any, source: str | None = None) -> Iterator[None]:
    """``offline_unless_needed``'s rule for the length of a block (``omnispec.build`` from Python, where the process
    goes on to other work): offline inside when ``spec`` needs nothing from the Hub and HF_HUB_OFFLINE is unset, as
    before afterwards. ``spec`` None (not readable yet: the block itself says why) changes nothing. A library first
    imported inside keeps what it read at its import (diffusers reads the setting once: for its telemetry header and
    a Hub attention kernel's publisher check)."""
    if spec is None or not _may_go_offline(spec, source, downloads=True):
        yield
        return
    _set_offline(True)
    try:
        yield
    finally:
        _set_offline(False)


def _may_go_offline(spec: Any, source: str | None, downloads: bool) -> bool:
    return "HF_HUB_OFFLINE" not in os.environ and not (downloads and needs_hub(spec, source))


def _set_offline(offline: bool) -> None:
    """HF_HUB_OFFLINE set (or unset again), and huggingface_hub told when imported already (it reads the variable
    at its import)."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    else:
        os.environ.pop("HF_HUB_OFFLINE", None)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = offline or _true(os.environ.get("TRANSFORMERS_OFFLINE"))


def check_reachable(ref: str, where: str, instead: str = LOCAL_CHECKPOINT) -> None:
    """A Hub id while the Hub is unreachable (and HF_HUB_OFFLINE unset): refused at once, naming the way out
    (``instead``: what to give in its place)."""
    if not is_hub_id(ref) or hub_offline():
        return
    unreachable = hub_unreachable()
    if unreachable:
        raise SpecError.single(
            f"{ref!r} is a Hub id, and the Hugging Face Hub is unreachable from here ({unreachable}): give {instead}, "
            "or set HF_HUB_OFFLINE=1 to use the local cache", where)


def hub_file(repo: str, name: str, revision: str | None = None) -> Path | None:
    """A small file of a Hub repository: from the local cache, else downloaded (unless HF_HUB_OFFLINE); None when
    the repository has no such file."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo, name, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline():
        return None
    try:
        return Path(hf_hub_download(repo, name, revision=revision))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


__all__ = ["check_reachable", "hub_file", "hub_offline", "hub_path_problem", "hub_unreachable", "is_hub_id",
           "needs_hub", "offline_unless_needed", "offline_while_local"]
