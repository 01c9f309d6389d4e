"""A component's single weights file (``model.components.NAME.file``): where it is, and what its header holds.

A user's file is a path of their own (``/models/flux1-dev.safetensors``, ``./wan.gguf`` next to the spec), a file
inside the component's checkpoint folder (``diffusion_pytorch_model.safetensors``), or a file of a Hub repository
(``city96/FLUX.1-dev-gguf/flux1-dev-Q4_0.gguf``: owner, name, then the path in the repository). Its header is read
and checked here (safetensors or GGUF, nothing else) before any library opens it; the tensor names and shapes are
what family detection and the shape check work from. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecError, first_line
from .files import path_kind, refuse_pickle, safetensors_header, user_path
from .gguf import gguf_header
from .hub import hub_offline, hub_path_problem, is_hub_id
from .model import Component

FORMATS = {".safetensors": "safetensors", ".gguf": "gguf"}


@dataclass(frozen=True)
class StoredTensor:
    dtype: str  # a safetensors dtype (BF16, F8_E4M3 ...) or a ggml type (Q4_0, F32 ...)
    shape: tuple[int, ...]  # the values' shape (a GGUF block-quantized tensor's logical shape, not its bytes')
    nbytes: int
    quantized: bool  # GGUF blocks: the loader keeps them packed and dequantizes in each forward

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightsFile:
    path: Path
    format: str  # "safetensors" | "gguf"
    tensors: dict[str, StoredTensor]
    architecture: str | None = None  # GGUF general.architecture (city96's files: flux, wan, lumina2 ...)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def describe(self) -> str:
        """``GGUF, 240 Q4_0 + 160 F32 tensors`` / ``safetensors, 780 BF16 tensors``."""
        if self.format == "pickle":
            return "a pickled file, trusted (--trust-code)"
        types = " + ".join(f"{n} {t}" for t, n in self.type_counts().items())
        return f"{'GGUF' if self.format == 'gguf' else 'safetensors'}, {types} tensors"


def file_format(file: str) -> str | None:
    """``safetensors`` / ``gguf`` from the name, or None for anything else."""
    return FORMATS.get(Path(file).suffix.lower())


def own_path(file: str) -> bool:
    """Whether ``file`` is a path of the user's own (absolute, or starting with ``./``, ``../`` or ``~``), not a file
    inside the component's folder or a Hub file."""
    return Path(file).is_absolute() or file.startswith(("./", "../", "~"))


def hub_file_ref(file: str) -> tuple[str, str] | None:
    """``(owner/name, path in the repository)`` when ``file`` reads as a Hub file reference (a Hub id, then a path of
    one or more names), else None."""
    if own_path(file) or file.count("/") < 2:
        return None
    owner, name, rest = file.split("/", 2)
    repo = f"{owner}/{name}"
    return (repo, rest) if is_hub_id(repo) and hub_path_problem(rest) is None else None


def locate(component: Component, root: str | None, where: str, revision: str | None = None,
           fetch: bool = True) -> Path | None:
    """The local path of ``component.file``: the user's own path, the file inside the component's local folder,
    else a Hub file (from the cache, or downloaded when ``fetch`` and online). None when it is a Hub file that is
    neither cached nor fetched. A path that names nothing is an error naming what was looked for."""
    file = component.file
    assert file is not None
    if own_path(file):
        return _existing(user_path(file), where)
    if problem := hub_path_problem(file):
        raise SpecError.single(problem, where)
    home = component.source or root
    if home and path_kind(user_path(home)) == "dir":
        inside = user_path(home) / (component.subfolder or "") / file
        if path_kind(inside) is not None or hub_file_ref(file) is None:
            return _existing(inside, where)
    ref = hub_file_ref(file)
    if ref is not None:
        return _hub(ref[0], ref[1], where, revision, fetch)
    if home and "/" in home and path_kind(user_path(home)) is None:  # inside a Hub checkpoint's component folder
        return _hub(home, f"{component.subfolder}/{file}" if component.subfolder else file, where, revision, fetch)
    raise SpecError.single(f"cannot find {file!r}: give a path (/x/model.safetensors, ./model.gguf), a file inside "
                           "the component's folder of model.source, or a Hub file as owner/name/path", where)


def _existing(path: Path, where: str) -> Path:
    kind = path_kind(path)
    if kind is None:
        raise SpecError.single(f"no such weights file: {path}", where)
    if kind != "file":
        raise SpecError.single(f"{path} is {'a directory' if kind == 'dir' else 'not a regular file'}, not a weights "
                               "file", where)
    return path


def _hub(repo: str, name: str, where: str, revision: str | None, fetch: bool) -> Path | None:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo, name, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if not fetch:
        return None
    if hub_offline():
        raise SpecError.single(f"{repo}/{name} is a Hub file that is not in the local cache, and HF_HUB_OFFLINE is "
                               "set: download it or give a local path", where)
    try:
        return Path(hf_hub_download(repo, name, revision=revision))
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        first = first_line(exc) or type(exc).__name__
        raise SpecError.single(f"cannot fetch {repo}/{name}: {first}", where) from None


def read_weights_file(path: Path, where: str, trusted: bool = False) -> WeightsFile:
    """The file's tensors from its header (safetensors or GGUF, checked within bounds); a pickle is refused unless
    ``trusted``, and then has no header to read (an empty table)."""
    refuse_pickle(path, where, trusted)
    kind = file_format(path.name)
    if kind == "safetensors":
        header = safetensors_header(path, where)
        tensors = {k: StoredTensor(e.dtype, e.shape, e.end - e.begin, False) for k, e in header.tensors.items()}
        return WeightsFile(path, kind, tensors)
    if kind == "gguf":
        gguf = gguf_header(path, where)
        tensors = {k: StoredTensor(t.dtype, t.shape, t.end - t.begin, t.quantized) for k, t in gguf.tensors.items()}
        return WeightsFile(path, kind, tensors, gguf.architecture)
    if trusted:
        return WeightsFile(path, "pickle", {})
    raise SpecError.single(f"{path}: weights are read from .safetensors or .gguf files", where)


__all__ = ["FORMATS", "StoredTensor", "WeightsFile", "file_format", "hub_file_ref", "locate", "own_path",
           "read_weights_file"]
