"""The version of omnispec (the one place it is written) and of the libraries an output's record names."""

from __future__ import annotations

import importlib.metadata

__version__ = "0.1.0"

# The libraries whose versions decide an output bit for bit (recorded in every output; replay compares them).
RECORDED_LIBRARIES = ("diffusers", "transformers", "torch")


def library_versions() -> dict[str, str | None]:
    """omnispec's version and the installed versions of ``RECORDED_LIBRARIES`` (None: not installed)."""
    found: dict[str, str | None] = {"omnispec": __version__}
    for package in RECORDED_LIBRARIES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def minor(version: str | None) -> str | None:
    """``"0.42"`` for ``"0.42.1"`` (or ``"2.13"`` for ``"2.13.0+cpu"``): the part a drift check compares."""
    if not version:
        return None
    return ".".join(version.split("+")[0].split(".")[:2])


__all__ = ["RECORDED_LIBRARIES", "__version__", "library_versions", "minor"]
