"""Guidance plans: which extra denoiser passes run at a step and how their predictions combine.

Each term kind is one file here, holding its spec class and its ``Term`` (its pass, coefficient, combine rule,
refusals), registered in ``GUIDANCE``; ``docs/architecture.md`` shows adding one. The linear terms share the delta
form ``pred = cond + sum_i c_i * (cond - pass_i)``; APG and CFG-zero* combine their pass by their own rule;
``rescale`` and ``renorm`` apply last.
"""

from .apg import APG
from .base import (
           GUIDANCE,
           Scale,
           ScaleSchedule,
           StreamScale,
           Term,
           TermSpec,
           Window,
           pass_name,
           scale_at,
           stream_scale_at,
           term_of,
)
from .cfg import CFG, TrueCFG
from .cfg_zero_star import CFGZeroStar
from .modality import Modality
from .skip_layer import SkipLayer
from .spec import GuidanceSpec, Renorm

__all__ = ["APG", "CFG", "GUIDANCE", "CFGZeroStar", "GuidanceSpec", "Modality", "Renorm", "Scale", "ScaleSchedule",
           "SkipLayer", "StreamScale", "Term", "TermSpec", "TrueCFG", "Window", "pass_name", "scale_at",
           "stream_scale_at", "term_of"]
