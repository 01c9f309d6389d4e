"""The attention policy's target: which attention modules of a denoiser play which role."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AttentionTarget:
    """``roles``: role -> fnmatch patterns of attention module names (modules with a ``processor``), first match
    wins. ``categories``: role -> category (``self``, ``cross``): a role not named in ``policies.attention.per_role``
    takes its category's entry there, then the default. ``qk_norm_rope_processor``: the processor
    ``policies.attention.fused_qk_norm_rope`` gives an attention, built from the one it replaces and the fused
    operator the policy hands over (None from it: that attention keeps its processor; None here: the family has none,
    and the field is refused). ``head_shape``: how to read an attention module's head count and size where it does
    not name them as diffusers' ``Attention`` does."""

    roles: Mapping[str, tuple[str, ...]]
    categories: Mapping[str, str] = field(default_factory=dict)
    qk_norm_rope_processor: Callable[[Any, Callable[..., Any]], Any] | None = None
    # (heads, head_dim) of one attention module, for modules without diffusers' ``Attention`` attributes (``heads``,
    # ``inner_dim`` or ``to_q``); None reads those.
    head_shape: Callable[[Any], tuple[int, int]] | None = None

    def names(self) -> list[str]:
        """Every name ``per_role`` may use: the roles, then their categories."""
        return [*self.roles, *sorted(set(self.categories.values()) - set(self.roles))]

    def role_key(self, role: str, per_role: Mapping[str, str]) -> str | None:
        """The ``per_role`` entry that decides ``role``: the role itself, else its category (LTX-2's ``video_self``
        falls back to ``self``), else None (the default decides)."""
        if role in per_role:
            return role
        category = self.categories.get(role)
        return category if category in per_role else None

    def modules(self, named: Iterable[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
        """The attention modules (those with a ``processor``) of ``named`` (a denoiser's ``named_modules()``) by
        role."""
        out: dict[str, list[tuple[str, Any]]] = {}
        for name, module in named:
            if not hasattr(module, "processor"):
                continue
            for role, patterns in self.roles.items():
                if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    out.setdefault(role, []).append((name, module))
                    break
        return out
