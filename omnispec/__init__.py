"""omnispec: one typed spec describes a whole diffusion run; a small interpreter builds and runs it.

``import omnispec`` stays light: the runtime (torch, diffusers) is imported on first use of ``build``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import PipelineSpec, SpecError, compile_plan, dump_spec, json_schema, load_spec

if TYPE_CHECKING:
    from .runtime import Output, Pipeline

__version__ = "0.1.0"


def build(*args: Any, **kwargs: Any) -> Pipeline:
    """Build a runnable ``Pipeline`` (with RL rollouts and replay) from a spec; see ``omnispec.runtime.build``."""
    from .rl.pipeline import RLPipeline
    from .runtime import build as _build

    return _build(*args, pipeline_class=RLPipeline, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "Output"):
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'omnispec' has no attribute {name!r}")


__all__ = ["Output", "Pipeline", "PipelineSpec", "SpecError", "build", "compile_plan", "dump_spec", "json_schema", "load_spec"]
