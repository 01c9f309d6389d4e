"""The interpreter: ``build(spec) -> Pipeline``; ``Pipeline(prompt, seed, **request) -> Output``."""

from ..log import harmless_messages_demoted

with harmless_messages_demoted():  # torchao, transformers and diffusers say what they lack while imported
    from .build import build
    from .pipeline import Output, Pipeline

__all__ = ["Output", "Pipeline", "build"]
