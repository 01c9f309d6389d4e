"""The bundled specs: found by name (``flux1-dev`` or ``flux1-dev.yaml``) wherever omnispec is installed.

An installed omnispec holds them in the package (``omnispec/specs/``, mapped from the repository's ``specs/``
by pyproject); a source checkout or an editable install reads the repository's ``specs/`` folder itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import SpecError, quoted
from .suggest import close_names, did_you_mean, nearby_files

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def bundled_dir() -> Path | None:
    """The folder of bundled specs: in the installed package, else the source checkout's ``specs/``."""
    package = Path(__file__).resolve().parent.parent
    for folder in (package / "specs", package.parent / "specs"):
        if folder.is_dir():
            return folder
    return None


def bundled_names() -> list[str]:
    folder = bundled_dir()
    if folder is None:
        return []
    return sorted(p.stem for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file())


def bundled_path(name: str) -> Path | None:
    """The bundled spec called ``name`` (with or without its suffix), or None. Only plain names are looked up: a
    name with a folder in it is a path."""
    folder = bundled_dir()
    if folder is None or not _plain(name):
        return None
    stem = _stem(name)
    for suffix in SPEC_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def resolve_spec_path(ref: str | Path, relative_to: Path | None = None, where: str | None = None,
                      file: str | None = None) -> Path:
    """Where a spec reference points: an existing file (relative to ``relative_to`` when given) wins, then a
    bundled spec of that name. A reference that is neither raises ``SpecError`` naming the nearest ones."""
    path = Path(ref)
    local = relative_to / path if relative_to is not None and not path.is_absolute() else path
    try:
        if local.exists():
            return local
    except OSError:  # a name the OS refuses (too long): reading it reports why
        return local
    bundled = bundled_path(str(ref))
    if bundled is not None:
        return bundled
    raise SpecError.single(no_such_spec(str(ref), local), where, file)


LIST_HINT = "omnispec list names the bundled specs"


def no_such_spec(ref: str, local: Path) -> str:
    """That ``ref`` names no spec file (at ``local``) and, a plain name, no bundled spec; the nearest spec files
    beside it and bundled names, and where the bundled specs are listed."""
    plain = bundled_dir() is not None and _plain(ref)
    told = f"no such spec file {quoted(str(local))}"
    if plain:
        told += f" and no bundled spec named {quoted(ref)}"
    bundled = close_names(_stem(ref), bundled_names()) if plain else []
    return f"{told}{did_you_mean(nearby_files(local, SPEC_SUFFIXES) + bundled)} ({LIST_HINT})"


def _plain(name: str) -> bool:
    """A name that may be a bundled spec's: no folder in it."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _stem(name: str) -> str:
    for suffix in SPEC_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    family: str
    task: str
    source: str | None
    path: Path


def catalog() -> list[CatalogEntry]:
    """Every bundled spec, loaded and validated (``omnispec list``)."""
    from .loader import load_spec

    entries = []
    folder = bundled_dir()
    for name in bundled_names():
        path = bundled_path(name)
        assert path is not None and folder is not None
        spec = load_spec(path)
        entries.append(CatalogEntry(name, spec.model.family, spec.recipe.task, spec.model.source, path))
    return entries
