"""Read a spec (YAML/JSON file or dict), resolve ``extends``, apply dotted overrides, validate; and dump."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from .errors import SpecError, from_validation_error
from .pipeline import PipelineSpec

SpecSource = str | Path | Mapping[str, Any]


def load_spec(
    source: SpecSource, overrides: Iterable[str] = (), *, trust_code: bool = False
) -> PipelineSpec:
    """Load and validate a spec.

    ``source`` is a path to a ``.yaml``/``.yml``/``.json`` file or an already-parsed mapping.
    ``overrides`` are ``dotted.path=value`` strings (``recipe.phases.0.schedule.steps=8``); values are
    parsed as YAML scalars or lists. Raises ``SpecError`` naming the file and field path of each problem.
    """
    data, file = resolve_spec_data(source)
    for override in overrides:
        apply_override(data, override, file)
    return validate_spec(data, file, trust_code=trust_code)


def resolve_spec_data(source: SpecSource) -> tuple[dict[str, Any], str | None]:
    """The spec's merged data (``extends`` resolved) and the file it came from, before validation."""
    if isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
        if data.get("extends") is not None:
            raise SpecError.single("a spec given as a dict cannot use 'extends' (paths are relative to a file)", "extends")
        return data, None
    if not isinstance(source, (str, Path)):
        raise SpecError.single(f"a spec must be a mapping or a file path, got {type(source).__name__}")
    path = Path(source)
    return _read_with_extends(path, ()), str(path)


def validate_spec(data: Mapping[str, Any], file: str | None = None, *, trust_code: bool = False) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(data, context={"trust_code": trust_code})
    except ValidationError as exc:
        raise from_validation_error(exc, data, file) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SpecError.single(f"no such spec file: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError.single(f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}".replace("\n", " "), file=str(path)) from None
    if not isinstance(data, dict):
        raise SpecError.single(f"a spec must be a mapping at the top level, got {type(data).__name__}", file=str(path))
    return data


def _read_with_extends(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise SpecError.single(f"cyclic extends: {cycle}", "extends", str(path))
    data = _read_file(path)
    _anchor_local_source(data, path)
    base_ref = data.pop("extends", None)
    if base_ref is None:
        return data
    if not isinstance(base_ref, str):
        raise SpecError.single(f"extends must be a path, got {base_ref!r}", "extends", str(path))
    base_path = (path.parent / base_ref)
    if not base_path.is_file():
        raise SpecError.single(f"extends {base_ref!r}: no such file {base_path}", "extends", str(path))
    return deep_merge(_read_with_extends(base_path, (*chain, resolved)), data)


def _anchor_local_source(data: dict[str, Any], path: Path) -> None:
    """A ``model.source`` written as ``./x`` or ``../x`` is relative to the spec file, not the shell."""
    model = data.get("model")
    source = model.get("source") if isinstance(model, dict) else None
    if isinstance(source, str) and source.startswith(("./", "../")):
        model["source"] = str((path.parent / source).resolve())


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
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
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


def dump_spec(spec: PipelineSpec, format: Literal["yaml", "json"] = "yaml") -> str:
    """Serialise a spec; ``load_spec`` of the result equals ``spec``. Defaults are left out."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    data = {"omnispec": 1, **data}
    if format == "json":
        return json.dumps(data, indent=2) + "\n"
    if format == "yaml":
        return yaml.safe_dump(data, sort_keys=False)
    raise ValueError(f"format must be 'yaml' or 'json', got {format!r}")
