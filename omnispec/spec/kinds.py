"""One registry per concept of the spec that comes in kinds: guidance terms, caches, offload strategies, samplers,
schedules; and one for the parallel axes, which are degrees rather than kinds (``Axes``).

A concept's spec classes are pydantic models told apart by a tag field (``kind``; offload's is ``strategy``). Each
registers once, with the object that implements it: that object is the one place the kind's behaviour lives (what it
runs, what it refuses, what explain prints). The implementation may be given later, from the layer that runs it
(a cache's lives with the policies), and is looked up by ``implementation(spec)``: a kind without one is an error
naming it, never a fallback to another kind.

Spec models hold a concept through its registry (``Annotated[Base, CACHES]``): a tagged union built from the
registered classes whenever the holding model's schema is built, so a kind registered later (a test's, a plugin's)
joins every model listed in ``holders`` when ``register`` rebuilds them. Validation errors keep their field paths,
and the JSON Schema lists every registered variant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pydantic_core import core_schema


class Kinds:
    """The registry of one concept: tag value -> spec class, and -> the object implementing it."""

    def __init__(self, concept: str, tag: str = "kind"):
        self.concept, self.tag = concept, tag
        self.classes: dict[str, type] = {}
        self._implementations: dict[str, Any] = {}  # an object, or "module:attribute" imported on first use
        self.holders: list[type] = []  # models whose schema holds this concept, innermost first

    def register(self, cls: type | None = None, implementation: Any = None) -> Any:
        """Add a spec class (its tag is the ``Literal`` of its tag field), with its implementation or a
        ``"module:name"`` reference to it; rebuild the models that hold the concept. Usable as a decorator."""
        def add(spec_class: type) -> type:
            kind = tag_value(spec_class, self.tag)
            if kind in self.classes and self.classes[kind] is not spec_class:
                raise ValueError(f"{self.concept} kind {kind!r} is registered already ({self.classes[kind].__name__})")
            self.classes[kind] = spec_class
            if implementation is not None:
                self._implementations[kind] = implementation
            for holder in self.holders:
                holder.model_rebuild(force=True)
            return spec_class

        return add if cls is None else add(cls)

    def unregister(self, kind: str) -> None:
        """Take kind ``kind`` out again (a test's or a plugin's) and rebuild the models that hold the concept."""
        if kind not in self.classes:
            raise ValueError(f"{self.concept} kind {kind!r} is not registered")
        del self.classes[kind]
        self._implementations.pop(kind, None)
        for holder in self.holders:
            holder.model_rebuild(force=True)

    def implement(self, kind: str, implementation: Any) -> None:
        """Give kind ``kind`` its implementation (from the layer that runs it)."""
        if kind not in self.classes:
            raise ValueError(f"{self.concept} kind {kind!r} has no spec class; register one first")
        self._implementations[kind] = implementation

    def implementation(self, spec: Any) -> Any:
        """The object implementing ``spec``'s kind (a spec instance, class or tag value)."""
        kind = spec if isinstance(spec, str) else tag_value(spec if isinstance(spec, type) else type(spec), self.tag)
        return _resolved(self._implementations, kind, f"{self.concept} kind {kind!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.classes)

    def held_by(self, *models: type) -> None:
        """Record the models that hold this concept (innermost first), rebuilt whenever a kind registers."""
        self.holders.extend(models)

    # pydantic: the union of the registered classes, tagged by ``tag``
    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        choices = {kind: handler.generate_schema(cls) for kind, cls in self.classes.items()}
        if not choices:  # a concept nothing has registered a kind of yet (the kernel policies of plugins)
            return core_schema.no_info_after_validator_function(self._no_kind, core_schema.dict_schema())
        return core_schema.tagged_union_schema(choices, discriminator=self.tag)

    def _no_kind(self, value: Any) -> Any:
        raise ValueError(f"no {self.concept} kind is registered (a plugin registers one before its specs load)")


class Axes:
    """The registry of parallel axes: each degree field of ``ParallelPolicy`` -> the object implementing it, in
    the order the ranks' device mesh lays the axes out (outermost first). Unlike a kind, an axis is not chosen by
    a tag: every axis is always present, with degree 1 when unused."""

    def __init__(self, concept: str):
        self.concept = concept
        self._implementations: dict[str, Any] = {}
        self._off_mesh: set[str] = set()

    def register(self, name: str, implementation: Any, *, mesh: bool = True) -> None:
        """``mesh=False``: the axis adds no ranks of its own (it works within ranks the mesh axes lay out)."""
        if name in self._implementations:
            raise ValueError(f"{self.concept} {name!r} is registered already")
        self._implementations[name] = implementation
        if not mesh:
            self._off_mesh.add(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._implementations)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """The axes that lay ranks out, in mesh order; their degrees multiply to the world size."""
        return tuple(n for n in self._implementations if n not in self._off_mesh)

    def implementation(self, name: str) -> Any:
        return _resolved(self._implementations, name, f"{self.concept} {name!r}")


def _resolved(table: dict[str, Any], key: str, what: str) -> Any:
    """``table[key]``, a ``"module:attribute"`` reference imported (once) into the object it names."""
    found = table.get(key)
    if found is None:
        raise LookupError(f"{what} has no implementation registered")
    if isinstance(found, str):
        module, _, attribute = found.partition(":")
        found = table[key] = getattr(importlib.import_module(module), attribute)
    return found


def tag_value(cls: type, tag: str) -> str:
    """The tag a spec class declares: the one value of its ``Literal`` tag field."""
    field = cls.model_fields.get(tag)  # type: ignore[attr-defined]
    values = getattr(field.annotation, "__args__", ()) if field is not None else ()
    if len(values) != 1 or not isinstance(values[0], str):
        raise TypeError(f"{cls.__name__} needs a field {tag}: Literal['<kind>'] to register")
    return values[0]


__all__ = ["Axes", "Kinds", "tag_value"]
