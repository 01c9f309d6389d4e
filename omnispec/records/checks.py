"""What stops a record from making its output again here: components that were handed in memory, weights changed
in memory, a local checkpoint whose config files differ, a LoRA file that is gone or changed, another omnispec or
diffusers version."""

from __future__ import annotations

from pathlib import Path

from ..spec.errors import Problem, SpecError
from ..spec.files import path_kind
from ..version import library_versions
from .making import config_hashes, file_sha256
from .schema import LocalAdapter, LocalRoot, Record, version_drift


def recorded_source(record: Record) -> str | None:
    """The checkpoint root to build from again: the resolved directory of a local one (so a replay works from any
    working directory), the Hub id of a Hub one."""
    checkpoint = record.checkpoint
    described = checkpoint.roots.get(checkpoint.source or "")
    return described.path if isinstance(described, LocalRoot) else checkpoint.source


def replay_problems(record: Record, source: str | None) -> list[Problem]:
    """Why the recorded checkpoint can't make this output again here (``source``: a checkpoint given instead of
    the recorded one)."""
    checkpoint = record.checkpoint
    problems = []
    if checkpoint.in_memory:
        problems.append(Problem("checkpoint", f"components {checkpoint.in_memory} were handed to build() in "
                                "memory; the checkpoint alone does not make this output"))
    if record.weights_changed:
        problems.append(Problem("checkpoint", "the weights were changed in memory after loading (RL weight sync or "
                                "set_lora); the checkpoint alone does not make this output"))
    for home, described in checkpoint.roots.items():
        if not isinstance(described, LocalRoot):
            continue
        where = source if source is not None and home == checkpoint.source else described.path
        if path_kind(where) != "dir":
            problems.append(Problem("checkpoint", f"the checkpoint {described.path} is not here; give its "
                                    "location with --source (source=)"))
            continue
        recorded = described.config_sha256
        folders = {str(Path(name).parent) if Path(name).parent != Path(".") else "" for name in recorded}
        now = config_hashes(Path(where), folders)
        changed = sorted(name for name, digest in recorded.items() if now.get(name) != digest)
        if changed:
            problems.append(Problem("checkpoint", f"config files of {where} differ from the ones that made this "
                                    f"output: {', '.join(changed)}"))
    for name, adapter in checkpoint.adapters.items():
        if not isinstance(adapter, LocalAdapter):
            continue
        weights = Path(adapter.path)
        if path_kind(weights) != "file":
            problems.append(Problem(f"model.adapters.{name}", f"the LoRA file {weights} is not here"))
        elif file_sha256(weights) != adapter.sha256:
            problems.append(Problem(f"model.adapters.{name}", f"the LoRA file {weights} has changed since (its "
                                    "SHA-256 differs)"))
    return problems


def check_versions(record: Record, allow_drift: bool, file: str | None = None) -> list[str]:
    """The version drift between this installation and the record's (see ``version_drift``); refused unless
    ``allow_drift`` (``--allow-version-drift``), since another omnispec or diffusers minor may compute otherwise."""
    drift = version_drift(record.versions, library_versions())
    if drift and not allow_drift:
        raise SpecError.single(f"{'; '.join(drift)}: the output may not be made again bit for bit; pass "
                               "--allow-version-drift (allow_version_drift=True) to replay it anyway", "versions", file)
    return drift


__all__ = ["check_versions", "recorded_source", "replay_problems"]
