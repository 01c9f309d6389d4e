"""What an error line adds for the person reading it: the nearest known key for an unknown one, the nearest known
names for a name that names nothing (``errors.shortened`` cuts a user's long string to a length a line can carry)."""

from __future__ import annotations

import difflib
import itertools
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .errors import Problem, quoted
from .kinds import Kinds, tag_value


def close_names(word: str, known: list[str], most: int = 3) -> list[str]:
    """The names of ``known`` a user who typed ``word`` most likely meant: those that start with it, else the nearest
    by spelling (``difflib``), at most ``most``."""
    if not word:
        return []
    starting = [name for name in known if name.startswith(word) and name != word]
    return starting[:most] or difflib.get_close_matches(word, known, n=most, cutoff=0.55)


def nearby_files(path: Path, suffixes: tuple[str, ...], most: int = 1000) -> list[str]:
    """The files beside ``path`` (in its folder, the first ``most`` it lists) with one of ``suffixes`` whose names,
    suffixes aside, are closest to its name: what a user who typed ``path`` may have meant. [] where the folder
    cannot be read."""
    def stem(name: str) -> str:
        return next((name[:-len(s)] for s in suffixes if name.lower().endswith(s)), name)

    try:
        with os.scandir(path.parent) as entries:
            names = itertools.islice((e.name for e in entries if e.name.lower().endswith(suffixes)), most)
            files = {stem(name): name for name in sorted(names)}
    except OSError:
        return []
    return [str(path.parent / files[near]) for near in close_names(stem(path.name), list(files))]


def did_you_mean(names: list[str]) -> str:
    """``"; did you mean 'a', 'b' or 'c'?"``, or "" for no names."""
    if not names:
        return ""
    shown = [quoted(name) for name in names]
    return f"; did you mean {' or '.join([', '.join(shown[:-1]), shown[-1]] if len(shown) > 1 else shown)}?"


def with_suggestion(problem: Problem, data: Any) -> Problem:
    """``problem`` with "did you mean ...?" added when it is an unknown key close to a key its model knows."""
    if not problem.message.startswith("unknown key") or not problem.path:
        return problem
    *parent, key = problem.path.split(".")
    known = keys_at(parent, data)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        return problem
    return Problem(problem.path, f"{problem.message}; did you mean {close[0]!r}?", problem.file)


def keys_at(path: list[str], data: Any) -> list[str]:
    """The field names of the spec model at ``path`` in ``data`` (a spec's data); [] where it cannot be told."""
    from .pipeline import PipelineSpec

    kind: Any = PipelineSpec
    node = data
    for part in path:
        kind = _item(kind, part, node)
        node = node.get(part) if isinstance(node, Mapping) else (
            node[int(part)] if isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) <
            len(node) else None)
        kind = _model(kind, node)
        if kind is None:
            return []
    kind = _model(kind, node)
    return list(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else []


def _item(kind: Any, part: str, node: Any) -> Any:
    """The type one step down ``kind`` at ``part``: a model's field, a list's or a dict's items."""
    kind = _model(kind, node)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        field = kind.model_fields.get(part)
        if field is None:
            return None
        kinds = [m for m in field.metadata if isinstance(m, Kinds)]  # pydantic keeps Annotated's extras here
        return typing.Annotated[field.annotation, kinds[0]] if kinds else field.annotation
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        return typing.get_args(kind)[0]
    if origin is dict:
        return typing.get_args(kind)[1]
    return None


def _model(kind: Any, node: Any) -> Any:
    """``kind`` with ``Annotated``, ``Optional`` and the kinds registries unwrapped to the one class ``node`` is."""
    while True:
        if typing.get_origin(kind) is typing.Annotated:
            base, *extra = typing.get_args(kind)
            registry = next((e for e in extra if isinstance(e, Kinds)), None)
            if registry is None:
                kind = base
                continue
            tag = node.get(registry.tag) if isinstance(node, Mapping) else None
            return registry.classes.get(tag) if isinstance(tag, str) else None
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(models) == 1:
                return models[0]
            tagged = [m for m in models if isinstance(node, Mapping) and _tag_of(m) == node.get("kind")]
            return tagged[0] if tagged else None
        return kind


def _tag_of(model: type) -> str | None:
    try:
        return tag_value(model, "kind")
    except TypeError:
        return None
