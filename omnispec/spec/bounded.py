"""Parse YAML and JSON text from a file a user hands omnispec, within bounds measured before anything is built.

Every reader of user files (specs, output records, a checkpoint's config files, safetensors headers) goes through
``parse_yaml`` / ``parse_json`` with the ``Bounds`` of what it reads: bytes (checked by the caller before decoding),
nesting depth and number of values, aliases expanded. A hostile file (an alias bomb, 100,000 nested lists, a
megabyte of one-character values) is refused naming the limit after reading a few hundred nodes, without deep
recursion or quadratic scans.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .base import MAX_SPEC_BYTES, MAX_SPEC_DEPTH, MAX_SPEC_NODES
from .errors import SpecError


@dataclass(frozen=True)
class Bounds:
    """What one file may hold: its size in bytes, its nesting depth, its values (aliases expanded)."""

    bytes: int
    depth: int
    nodes: int
    what: str  # how errors name the limit: "the limit for a spec"


SPEC = Bounds(MAX_SPEC_BYTES, MAX_SPEC_DEPTH, MAX_SPEC_NODES, "a spec")
# An output record holds a resolved spec (nested one level deeper) and a request (prompts of a batch).
RECORD = Bounds(4 << 20, MAX_SPEC_DEPTH + 8, 200_000, "an output record")
# A checkpoint's own JSON files that omnispec reads: model_index.json, config.json, scheduler_config.json,
# *.safetensors.index.json (19B-parameter models' indexes are ~0.5 MB), a safetensors file's header.
CONFIG = Bounds(16 << 20, MAX_SPEC_DEPTH, 1_000_000, "a checkpoint's config file")
# A tokenizer's vocabulary files (tokenizer.json, vocab.json: tens of MB for 250k-token vocabularies), which the
# tokenizer libraries parse themselves: measured (bytes, depth) without being decoded here.
TOKENIZER = Bounds(128 << 20, MAX_SPEC_DEPTH, 0, "a tokenizer file")


class _LimitExceeded(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the node graph bounded while it is composed (nesting depth, node count) and,
    aliases expanded, before anything is constructed."""

    def __init__(self, stream: str, bounds: Bounds):
        super().__init__(stream)
        self._bounds = bounds
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > self._bounds.depth:
                raise _LimitExceeded(f"nested deeper than {self._bounds.depth} levels")
            if self._nodes > self._bounds.nodes:
                raise _LimitExceeded(f"more than {self._bounds.nodes:,} values")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _yaml_children(node: Any) -> list[Any] | None:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return None


def parse_yaml(text: str, file: str | None = None, bounds: Bounds = SPEC) -> Any:
    """YAML text to plain data (safe tags only); what exceeds a limit is refused naming the limit."""
    try:
        loader = _BoundedLoader(text, bounds)  # refuses unprintable characters at once
    except yaml.YAMLError as exc:
        raise SpecError.single(f"not valid YAML: {exc}".replace("\n", " "), file=file) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, _yaml_children, bounds)
        return loader.construct_document(node)
    except _LimitExceeded as exc:
        raise SpecError.single(f"not read: {exc} (aliases expanded), the limit for {bounds.what}", file=file) from None
    except yaml.YAMLError as exc:
        raise SpecError.single(f"not valid YAML: {exc}".replace("\n", " "), file=file) from None
    finally:
        loader.dispose()


# One token of the depth scan: an escape (inside strings only), a quote, or a bracket. Matched left to right once,
# so the scan is linear whatever the text (a pattern for whole strings backtracks on unterminated ones).
_JSON_TOKENS = re.compile(r'\\.|["\[\]{}]')


def _json_too_deep(text: str, limit: int) -> bool:
    depth, in_string = 0, False
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token[0] == "\\":
            continue
        if token == '"':
            in_string = not in_string
        elif not in_string:
            depth += 1 if token in "[{" else -1
            if depth > limit:
                return True
    return False


def check_json_depth(text: str, file: str | None = None, bounds: Bounds = SPEC) -> None:
    """Refuse JSON text nested deeper than the limit, measured on the text (linear, no recursion): what a library's
    recursive decoder would fail on with a RecursionError."""
    if _json_too_deep(text, bounds.depth):
        raise SpecError.single(f"not read: nested deeper than {bounds.depth} levels, the limit for {bounds.what}",
                               file=file)


def parse_json(text: str, file: str | None = None, bounds: Bounds = SPEC) -> Any:
    """JSON text to data; its nesting is measured on the text first, so deep input never reaches the
    recursive decoder."""
    check_json_depth(text, file, bounds)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise SpecError.single(f"not valid JSON: {exc}".replace("\n", " "), file=file) from None
    check_bounds(data, file, bounds)
    return data


def decode_utf8(raw: bytes, file: str | None) -> str:
    """UTF-8 text (a BOM allowed), or ``SpecError`` naming the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError.single(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (save the file "
                               "as UTF-8)", file=file) from None


def _data_children(value: Any) -> list[Any] | None:
    if isinstance(value, Mapping):
        return [part for pair in value.items() for part in pair]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def check_bounds(data: Any, file: str | None = None, bounds: Bounds = SPEC) -> None:
    """Refuse data (a spec given as a dict, a parsed JSON file) nested deeper than the limit, holding more
    values than the limit, or containing itself."""
    try:
        _measure(data, _data_children, bounds)
    except _LimitExceeded as exc:
        raise SpecError.single(f"not read: {exc}, the limit for {bounds.what}", file=file) from None


def _measure(root: Any, children: Callable[[Any], list[Any] | None], bounds: Bounds) -> None:
    """Count the values under ``root``, a shared part (a YAML alias) once per use, and its depth. Each
    container is visited once, so measuring an alias bomb costs what reading it cost."""
    sizes: dict[int, tuple[int, int]] = {}  # id -> (values, height)
    open_ids: set[int] = set()

    def visit(node: Any, depth: int) -> tuple[int, int]:
        kids = children(node)
        if kids is None:
            return 1, 1
        key = id(node)
        if key in open_ids:
            raise _LimitExceeded("a value that contains itself (a recursive alias)")
        if key not in sizes:
            if depth > bounds.depth:
                raise _LimitExceeded(f"nested deeper than {bounds.depth} levels")
            open_ids.add(key)
            count, height = 1, 1
            for kid in kids:
                c, h = visit(kid, depth + 1)
                count, height = count + c, max(height, h + 1)
                if count > bounds.nodes:
                    raise _LimitExceeded(f"more than {bounds.nodes:,} values")
            open_ids.discard(key)
            sizes[key] = (count, height)
        count, height = sizes[key]
        if depth + height - 1 > bounds.depth:
            raise _LimitExceeded(f"nested deeper than {bounds.depth} levels")
        return count, height

    visit(root, 1)


__all__ = ["CONFIG", "RECORD", "SPEC", "TOKENIZER", "Bounds", "check_bounds", "check_json_depth", "decode_utf8",
           "parse_json", "parse_yaml"]
