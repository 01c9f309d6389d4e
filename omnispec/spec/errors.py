"""``SpecError``: every problem with a spec, each as file + field path + what was expected."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# Keys that select a variant of a discriminated union; pydantic puts the chosen value in the error
# path (``schedule.flow_match.steps``), which we drop so paths match the file (``schedule.steps``).
_DISCRIMINATORS = ("kind", "strategy")


# Characters that act on a terminal instead of showing: C0 and C1 controls but tab (escape sequences, a carriage
# return that overwrites the line, a newline that starts a line without the ``error:`` prefix) and the bidi overrides
# that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

LONGEST = 80  # characters of a user's string (a value, a key, a name, a file) an error line quotes
# The longest message of one problem: whatever path a user's string takes into it (a library's message quoting it, a
# list of them), an ``error:`` line stays a line.
LONGEST_MESSAGE = 1000


def shortened(text: str, limit: int = LONGEST) -> str:
    """``text``, or its start and how long it was when longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    return f"{text[:limit - 25]}... ({len(text):,} characters)"


def quoted(value: Any) -> str:
    """``value`` as an error line quotes it: a string shortened, then in quotes; anything else's ``repr`` shortened."""
    return repr(shortened(value)) if isinstance(value, str) else shortened(repr(value))


_LONG_QUOTED = re.compile(f"'([^'\\n]{{{LONGEST + 1},}})'")


def quoted_values_shortened(message: str) -> str:
    """``message`` with each value it quotes (``'...'``, as ``repr`` and argparse quote) longer than ``LONGEST``
    shortened: for a message made elsewhere, which quotes a user's value whole."""
    return _LONG_QUOTED.sub(lambda m: quoted(m.group(1)), message)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, "" when it has none: what an ``error:`` line or a warning quotes
    of an error raised by a library (whose later lines are its own traceback or details)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every control character as its Python escape (``\\x1b``, ``\\n``).
    Strings from files (a record's versions, a config's keys) reach ``error:`` lines and ``explain``'s text."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    file: str | None = None

    def __str__(self) -> str:
        """``file: path: message``, each part shortened: every key of the path to ``LONGEST`` characters, the file
        to twice that (a path in folders; an override already shortened), a message longer than ``LONGEST_MESSAGE``
        first by the values it quotes, then to that length (``path`` itself stays whole: suggestions read it)."""
        path = ".".join(shortened(part) for part in self.path.split(".")) if self.path else ""
        where = ": ".join(x for x in (shortened(self.file, 2 * LONGEST) if self.file else None, path) if x)
        message = self.message
        if len(message) > LONGEST_MESSAGE:
            message = shortened(quoted_values_shortened(message), LONGEST_MESSAGE)
        return f"{where}: {message}" if where else message


class SpecError(ValueError):
    """A spec (or a request against it) is invalid; ``problems`` lists each finding."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    @classmethod
    def single(cls, message: str, path: str = "", file: str | None = None) -> SpecError:
        return cls([Problem(path, message, file)])

    def __reduce__(self):
        # rebuilt from its problems: the default pickles ``args`` (the joined message) as if they were the problems,
        # and an error raised in a Ray worker or a spawned process came back garbled
        return type(self), (self.problems,)


class LaunchError(SpecError):
    """The launch environment itself is wrong (torchrun's variables, a rendezvous nobody answers): every process says
    so, since none can tell whether the rank that speaks for the others exists."""


class SpecTypeError(SpecError, TypeError):
    """An argument of the wrong type (``prompt=123``, ``seed="abc"``): a ``TypeError`` and a ``SpecError``, so
    both ``except TypeError`` and the CLI's handling of bad input catch it."""


# How pydantic names the branches of a plain union in an error's location.
_BRANCH_PREFIXES = ("function-", "tuple[", "list[", "dict[", "literal[")


def _strip_union_tags(loc: tuple[Any, ...], data: Any) -> list[str]:
    parts: list[str] = []
    node = data
    for segment in loc:
        if isinstance(node, dict):
            if segment in node:
                node = node[segment]
            elif any(node.get(d) == segment for d in _DISCRIMINATORS) or segment in ("float", "ScaleSchedule"):
                continue  # the union tag pydantic inserted
            else:
                node = None
        elif isinstance(node, list) and isinstance(segment, int) and 0 <= segment < len(node):
            node = node[segment]
        elif isinstance(segment, str) and (segment.startswith(_BRANCH_PREFIXES) or segment in (
            "float", "int", "str", "bool", "ScaleSchedule", "literal['dynamic']", "literal['first']", "none"
        )):
            continue  # a branch name of a plain (non-discriminated) union
        else:
            node = None
        parts.append(str(segment))
    return parts


def _describe(err: dict[str, Any], data: Any) -> tuple[str, str]:
    parts = _strip_union_tags(err["loc"], data)
    kind = err["type"]
    if kind == "extra_forbidden":
        return ".".join(parts), f"unknown key {quoted(parts[-1])}"
    if kind == "missing":
        return ".".join(parts), "required key is missing"
    if kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        return ".".join(parts + [str(ctx.get("discriminator", "kind")).strip("'")]), (
            f"unknown variant {quoted(ctx.get('tag'))}; expected one of {ctx.get('expected_tags')}"
        )
    if kind == "union_tag_not_found":
        ctx = err.get("ctx", {})
        return ".".join(parts), f"missing {ctx.get('discriminator', 'kind')} (which variant this is)"
    msg = err["msg"]
    if kind not in ("spec_rule", "value_error"):
        msg = f"{msg} (got {quoted(err.get('input'))})"
    return ".".join(parts), msg.removeprefix("Value error, ")


def from_validation_error(exc: ValidationError, data: Any, file: str | None = None) -> SpecError:
    errors = exc.errors()
    # A non-finite number in a union field (``float | 'dynamic'``) fails every branch; the finite-number error
    # is the one that says what is wrong.
    non_finite = {tuple(_strip_union_tags(e["loc"], data)) for e in errors if e["type"] == "finite_number"}
    problems: list[Problem] = []
    for err in errors:
        if err["type"] != "finite_number" and tuple(_strip_union_tags(err["loc"], data)) in non_finite:
            continue
        path, message = _describe(err, data)
        problem = Problem(path, message, file)
        if problem not in problems:
            problems.append(problem)
    return SpecError(problems)
