"""The interpreter: ``build(spec) -> Pipeline``; ``Pipeline(prompt, seed, **request) -> Output``."""

from .build import build
from .pipeline import Output, Pipeline

__all__ = ["Output", "Pipeline", "build"]
