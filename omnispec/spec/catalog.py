"""The bundled specs: found by name (``flux1-dev`` or ``flux1-dev.yaml``) wherever omnispec is installed.

An installed omnispec holds them in the package (``omnispec/specs/``, mapped from the repository's ``specs/``
by pyproject); a source checkout or an editable install reads the repository's ``specs/`` folder itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import SpecError

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
    if folder is None or not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    stem = name
    for suffix in SPEC_SUFFIXES:
        stem = stem.removesuffix(suffix)
    for suffix in SPEC_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def resolve_spec_path(ref: str | Path, relative_to: Path | None = None, where: str | None = None,
                      file: str | None = None) -> Path:
    """Where a spec reference points: an existing file (relative to ``relative_to`` when given) wins, then a
    bundled spec of that name. A reference that is neither raises ``SpecError`` naming the bundled specs."""
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
    names = bundled_names()
    known = f"; bundled specs: {', '.join(names)}" if names else ""
    raise SpecError.single(f"no such spec file {str(local)!r} and no bundled spec named {str(ref)!r}{known}", where,
                           file)


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
