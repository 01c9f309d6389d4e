"""Read a spec (YAML/JSON file or dict), resolve ``extends``, apply dotted overrides, validate; and dump."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from .base import MAX_EXTENDS, MAX_SPEC_BYTES, MAX_SPEC_DEPTH
from .bounded import check_bounds, decode_utf8, parse_json, parse_yaml
from .catalog import bundled_path, resolve_spec_path
from .errors import Problem, SpecError, SpecTypeError, from_validation_error, quoted, shortened
from .pipeline import PipelineSpec
from .suggest import with_suggestion

SpecSource = str | Path | Mapping[str, Any]


def load_spec(
    source: SpecSource, overrides: Iterable[str] = (), *, trust_code: bool = False, overrides_from: str = "override"
) -> PipelineSpec:
    """Load and validate a spec.

    ``source`` is a path to a ``.yaml``/``.yml``/``.json`` file, a bundled spec's name (``flux1-dev``; an existing
    file of that name wins) or an already-parsed mapping. ``extends`` names a file relative to the spec's own,
    or a bundled spec.
    ``overrides`` are ``dotted.path=value`` strings (``recipe.phases.0.schedule.steps=8``); values are
    parsed as YAML scalars or lists. Raises ``SpecError`` naming the file and field path of each problem, or the
    override a problem comes from (``overrides_from``: how the caller's user gave them, ``--set`` on the command line),
    with the nearest known key for an unknown one (``SpecTypeError``, also a ``TypeError``, for an argument of the
    wrong type). Files are read within the
    limits of README's "Limits and errors" (size, nesting, values with aliases expanded, extends chain).
    """
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Iterable):
        raise SpecTypeError.single(f"overrides is a list of 'key=value' strings, got {type(overrides).__name__}",
                                   "overrides")
    data, file = resolve_spec_data(source)
    overrides = list(overrides)
    for override in overrides:
        if not isinstance(override, str):
            raise SpecTypeError.single(f"an override is a 'key=value' string, got {type(override).__name__}",
                                       "overrides")
        apply_override(data, override, f"{overrides_from} {quoted(override)}")
    try:
        return validate_spec(data, file, trust_code=trust_code)
    except SpecError as exc:
        raise SpecError([_attributed(p, overrides, overrides_from) for p in exc.problems]) from None


def _attributed(problem: Problem, overrides: list[str], overrides_from: str) -> Problem:
    """``problem`` blamed on the last override whose key path it lies on (or under), else left on the file."""
    at = problem.path.split(".") if problem.path else []
    for override in reversed(overrides):
        key = override.partition("=")[0].strip().split(".")
        if at and (at[:len(key)] == key or key[:len(at)] == at):
            return Problem(problem.path, problem.message, f"{overrides_from} {quoted(override)}")
    return problem


def resolve_spec_data(source: SpecSource) -> tuple[dict[str, Any], str | None]:
    """The spec's merged data (``extends`` resolved) and the file it came from, before validation."""
    if isinstance(source, Mapping):
        check_bounds(source)
        data = copy.deepcopy(dict(source))
        base_ref = data.pop("extends", None)
        if base_ref is None:
            return data, None
        if not isinstance(base_ref, str) or bundled_path(base_ref) is None:
            raise SpecError.single(f"a spec given as a dict can extend a bundled spec by name, got {quoted(base_ref)} "
                                   "(a file path is relative to a spec file)", "extends")
        base = bundled_path(base_ref)
        assert base is not None
        return deep_merge(_read_with_extends(base, ()), data), None
    if not isinstance(source, (str, Path)):
        raise SpecTypeError.single(f"a spec must be a mapping or a file path, got {type(source).__name__}")
    if "\0" in str(source):
        raise SpecError.single(f"a file path cannot contain a NUL character: {quoted(str(source))}")
    path = Path(source)
    if not _present(path):
        path = resolve_spec_path(source)
    return _read_with_extends(path, ()), str(path)


def _present(path: Path) -> bool:
    """Whether ``path`` names something on disk (a name the OS refuses, too long: yes, so reading it says why)."""
    try:
        return path.exists() or path.is_symlink()
    except OSError:
        return True


def validate_spec(data: Mapping[str, Any], file: str | None = None, *, trust_code: bool = False) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(data, context={"trust_code": trust_code})
    except ValidationError as exc:
        found = from_validation_error(exc, data, file)
        raise SpecError([with_suggestion(p, data) for p in found.problems]) from None


def _read_file(path: Path) -> dict[str, Any]:
    text = read_text(path)
    data = parse_json(text, str(path)) if path.suffix.lower() == ".json" else parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise SpecError.single(f"a spec must be a mapping at the top level, got {type(data).__name__}", file=str(path))
    return data


def _resolved(path: Path) -> Path:
    """The absolute path of a spec file, links followed; a loop of links (``resolve`` raises RuntimeError) or a name
    the OS refuses is one ``SpecError`` naming the file."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:
        raise SpecError.single(f"cannot read the spec file: {exc}", file=str(path)) from None


def _read_with_extends(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = _resolved(path)
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise SpecError.single(f"cyclic extends: {cycle}", "extends", str(path))
    if len(chain) >= MAX_EXTENDS:
        raise SpecError.single(f"more than {MAX_EXTENDS} files in one extends chain, the limit for a spec", "extends",
                               str(path))
    data = _read_file(path)
    _anchor_local_source(data, path)
    base_ref = data.pop("extends", None)
    if base_ref is None:
        return data
    if not isinstance(base_ref, str) or not base_ref or "\0" in base_ref:
        raise SpecError.single(f"extends must be a file path or a bundled spec's name, got {quoted(base_ref)}",
                               "extends", str(path))
    base_path = resolve_spec_path(base_ref, path.parent, "extends", str(path))
    return deep_merge(_read_with_extends(base_path, (*chain, resolved)), data)


# ---- reading within limits ---------------------------------------------------------------------------------

def read_text(path: Path, limit: int = MAX_SPEC_BYTES) -> str:
    """A spec file's text: UTF-8 (a BOM is allowed), at most ``limit`` bytes (no more is ever read)."""
    try:
        if not path.is_file():
            shown = shortened(str(path))
            problem = f"no such spec file: {shown}" if not path.exists() else f"{shown} is not a regular file"
            raise SpecError.single(problem)
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:  # permissions, a file that vanished
        raise SpecError.single(f"cannot read the spec file: {exc.strerror or exc}", file=str(path)) from None
    if len(raw) > limit:
        raise SpecError.single(f"not read: larger than {limit:,} bytes, the limit for a spec file", file=str(path))
    return decode_utf8(raw, str(path))


def _anchor_local_source(data: dict[str, Any], path: Path) -> None:
    """A ``model.source`` (or a component's ``source`` or ``file``) written as ``./x`` or ``../x`` is relative to the
    spec file, not the shell."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    holders = [model, *[c for c in (model.get("components") or {}).values() if isinstance(c, dict)]] \
        if isinstance(model.get("components", {}), dict) else [model]
    for holder in holders:
        for key in ("source", "file"):  # a component's own weights file, likewise
            value = holder.get(key)
            if isinstance(value, str) and value.startswith(("./", "../")):
                holder[key] = str((path.parent / value).resolve())


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (lists included) in ``top`` replaces ``base``'s value."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(dict(out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(data: dict[str, Any], override: str, file: str | None = None) -> None:
    """Set ``a.b.0.c=value`` in place; list indices must exist (``-1`` addresses the last item)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError.single(f"override {override!r} must look like dotted.path=value", file=file)
    try:
        value = parse_yaml(raw, file) if raw.strip() else ""
    except SpecError as exc:
        if exc.problems[0].message.startswith("not read:"):
            raise SpecError.single(exc.problems[0].message, key, file) from None
        value = raw  # not YAML: the text itself
    parts = key.split(".")
    if len(parts) > MAX_SPEC_DEPTH:
        raise SpecError.single(f"override: a path of more than {MAX_SPEC_DEPTH} parts, the limit for a spec",
                               ".".join(parts[:3]) + "...", file)
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            try:
                index = int(part)
                node[index]  # noqa: B018 - bounds check
            except (ValueError, IndexError):
                raise SpecError.single(
                    f"override: {part!r} is not an index of a list of {len(node)}", where, file
                ) from None
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise SpecError.single(
                f"override: cannot descend into {type(node).__name__} value at {'.'.join(parts[:depth])}", where, file
            )


def spec_with_overrides(spec_or_path: Any, overrides: Iterable[str] = (), *, trust_code: bool = False) -> PipelineSpec:
    """The spec a ``PipelineSpec``, a file, a bundled spec's name or a mapping gives, with ``overrides`` applied (a
    ``PipelineSpec`` without overrides as it is)."""
    if isinstance(spec_or_path, PipelineSpec):
        if not overrides:
            return spec_or_path
        spec_or_path = yaml.safe_load(dump_spec(spec_or_path))
    return load_spec(spec_or_path, overrides, trust_code=trust_code)


def dump_spec(spec: PipelineSpec, format: Literal["yaml", "json"] = "yaml") -> str:
    """Serialise a spec; ``load_spec`` of the result equals ``spec``. Defaults are left out."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    data = {"omnispec": 1, **data}
    if format == "json":
        return json.dumps(data, indent=2) + "\n"
    if format == "yaml":
        return yaml.safe_dump(data, sort_keys=False)
    raise ValueError(f"format must be 'yaml' or 'json', got {format!r}")
