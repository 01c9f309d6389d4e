"""FLOP counts of omnispec's attention operators for torch's ``FlopCounterMode``, which counts only the operators it
has a formula for: without these, a forward whose attention runs on ``flash4`` or ``sage`` counts its matmuls alone
(at Wan2.1 14B's 32k tokens, half of the step's FLOPs) and an MFU computed from it reads half what it is. Each
operator counts as SDPA's exact attention of the same shapes (torch's own formulas), which is the work it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count


def _heads_first(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """[batch, tokens, heads, dim] (FA4's layout) as SDPA's [batch, heads, tokens, dim]."""
    batch, tokens, heads, dim = shape
    return batch, heads, tokens, dim


def register_tokens_first(forward, backward) -> None:
    """Formulas for an attention operator (``torch.ops.<namespace>.<name>``) in FA4's layout, ``forward(q, k, v, ...)`` and
    ``backward(grad_out, q, k, v, ...)``."""
    register_flop_formula(forward)(
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(
            _heads_first(q), _heads_first(k), _heads_first(v)))
    register_flop_formula(backward)(
        lambda grad_out, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
            _heads_first(grad_out), _heads_first(q), _heads_first(k), _heads_first(v)))


def register_heads_first(forward, backward) -> None:
    """Formulas for an attention operator (``torch.ops.<namespace>.<name>``) in SDPA's layout, ``forward(q, k, v, ...)`` and
    ``backward(grad_out, q, k, v, ...)``."""
    register_flop_formula(forward)(
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v))
    register_flop_formula(backward)(
        lambda grad_out, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad_out, q, k, v))
