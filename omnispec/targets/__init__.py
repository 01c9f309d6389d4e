"""What each technique needs from a model, as typed data: a family fills these in, policies read them.

One frozen dataclass per technique (``attention``, ``blocks``, ``mlp``, ``modulation``, ``parallel``, ``guidance``,
``video_tokens``), gathered in ``Targets`` with the cache kinds a denoiser cannot take (``cache_limits``). A family
declares on its class what is known before any weight loads (module names, patterns, refusals); an instance binds what
needs the instance (its modulation embeddings, when the family is built). A policy or axis takes the one target it
reads, never the family. A refusal names the family and the technique, in one of two forms: a technique whose target
the family lacks (``Targets.missing``), or one its target declares it cannot run, with the reason
(``Targets.refused``).

Nothing here imports torch: the spec's checks (before any weight loads) read the guidance and parallel targets too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .attention import AttentionTarget
from .blocks import BlocksTarget
from .guidance import GuidanceTarget
from .mlp import MlpTarget
from .modulation import ModulationTarget
from .parallel import ParallelTarget, TensorPlan
from .video import VideoTokensTarget

# How a refusal names each technique a family may lack: "family 'sd3' has no <what>".
TECHNIQUES = {
    "attention": "attention roles",
    "blocks": "block lists",
    "mlp": "tanh-GELU feed-forwards for fused_gelu to fuse",
    "modulation": "modulation table",
    "qk_norm_rope": "fused q/k norm + RoPE processor",
    "video_tokens": "video-only self-attention for sparse attention",
}


@dataclass(frozen=True)
class Targets:
    """Every technique's target of one family (``family``: its name, for refusals); None where it has none."""

    family: str = ""
    attention: AttentionTarget = field(default_factory=lambda: AttentionTarget({"self": ("*attn*",)}))
    blocks: BlocksTarget = field(default_factory=BlocksTarget)
    mlp: MlpTarget | None = None
    modulation: ModulationTarget | None = None
    parallel: ParallelTarget = field(default_factory=ParallelTarget)
    guidance: GuidanceTarget = field(default_factory=GuidanceTarget)
    video_tokens: VideoTokensTarget | None = None
    # Cache kinds this family's denoiser cannot take, with the reason (checked before loading).
    cache_limits: dict[str, str] = field(default_factory=dict)
    # Targets of techniques a plugin adds (a kernel policy it registers), by technique name.
    extra: dict[str, Any] = field(default_factory=dict)

    def find(self, technique: str) -> Any:
        """The target of ``technique`` (a built-in field, or a plugin's in ``extra``); None where the family has
        none."""
        if technique in self.__dataclass_fields__ and technique != "extra":
            return getattr(self, technique)
        return self.extra.get(technique)

    def missing(self, technique: str) -> str:
        """The refusal of a technique whose target this family lacks: "family 'sd3' has no modulation table"."""
        return f"family {self.family!r} has no {TECHNIQUES.get(technique, technique)}"

    def refused(self, technique: str, why: str) -> str:
        """The refusal of a technique this family's target declares it cannot run, with the target's reason:
        "family 'sd3' cannot run ulysses/ring: no context-parallel plan for ulysses/ring"."""
        return f"family {self.family!r} cannot run {technique}: {why}"


__all__ = ["AttentionTarget", "BlocksTarget", "GuidanceTarget", "MlpTarget", "ModulationTarget", "ParallelTarget",
           "TECHNIQUES", "Targets", "TensorPlan", "VideoTokensTarget"]
