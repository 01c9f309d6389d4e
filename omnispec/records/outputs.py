"""Where an output's files go, and whether they can be written, checked before any work: their suffixes, their names
(``name-0.png`` ... for several samples, a record beside the formats that hold none) and their folder. Torch-free, so
that a run's output-path mistake is told before any model library is imported."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..spec import Problem, SpecError
from ..spec.files import path_kind
from ..spec.videos import import_pyav
from .reading import SIDECAR_SUFFIXES, sidecar

IMAGE_SUFFIXES = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
VIDEO_SUFFIXES = (".gif", ".mp4", ".png")  # a video as .png: its frames side by side


def output_paths(path: Path, count: int) -> list[Path]:
    """``name.ext`` for one output, ``name-0.ext``, ``name-1.ext`` ... for several."""
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]


def check_output_path(path: Path, video: bool, samples: int = 1, *, overwrite: bool = False,
                      where: str = "--output", audio: bool = False) -> list[Path]:
    """The files a run of ``samples`` samples will write at ``path``, or ``SpecError`` naming every reason
    one of them can't be written (suffix, directory, parent, an existing file without ``overwrite``). With
    ``audio`` (a sound track: LTX-2), ``.wav`` writes the sound alone and ``.npy`` writes a ``.wav`` beside."""
    suffix = path.suffix.lower()
    allowed = (*VIDEO_SUFFIXES, ".npy") if video else (*IMAGE_SUFFIXES, ".npy")
    allowed = (*allowed, ".wav") if audio else allowed
    if path_kind(path) == "dir":
        example = path / ("out" + allowed[0])
        raise SpecError.single(f"{path} is a directory; give a file name in it, such as {example}", where)
    if suffix not in allowed:
        kind = "a video" if video else "an image"
        raise SpecError.single(f"cannot write {kind} task's output as {suffix or 'no suffix'}; use "
                               f"{', '.join(allowed)}", where)
    if suffix == ".mp4":
        import_pyav("writing .mp4", where)
    paths = output_paths(path, 1 if suffix == ".npy" else samples)
    if audio and suffix == ".npy":
        paths += output_paths(path.with_suffix(".wav"), samples)
    paths += [sidecar(p) for p in paths if p.suffix.lower() in SIDECAR_SUFFIXES]
    problems = _parent_problems(path.parent, where)
    for p in paths:
        if path_kind(p) == "dir":
            problems.append(Problem(where, f"{p} is a directory; give a file name such as {p / ('out' + suffix)}"))
        elif os.path.lexists(p) and not overwrite:
            flag = "--overwrite" if where.startswith("--") else "overwrite=True"
            problems.append(Problem(where, f"{p} exists; pass {flag} to replace it"))
    if problems:
        raise SpecError(problems)
    return paths


def _parent_problems(parent: Path, where: str) -> list[Problem]:
    """The nearest existing folder above the outputs must be a folder we may create files in."""
    existing = parent if str(parent) else Path(".")
    while path_kind(existing) is None and existing != existing.parent:
        if os.path.lexists(existing):  # a dangling link: its target folder does not exist
            return [Problem(where, f"{existing} is a broken link")]
        existing = existing.parent
    if path_kind(existing) != "dir":
        return [Problem(where, f"{existing} is a file, so {parent} cannot be a folder")]
    probe = existing / f".omnispec-probe-{secrets.token_hex(8)}"
    try:  # permissions, a read-only file system, /proc: only trying tells (root passes every access check)
        probe.open("xb").close()
    except OSError as exc:
        return [Problem(where, f"cannot create files in {existing}: {exc.strerror or exc}")]
    probe.unlink(missing_ok=True)
    return []
