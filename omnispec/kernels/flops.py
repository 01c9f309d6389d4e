"""FLOP counts of omnispec's attention operators for torch's ``FlopCounterMode``, which counts only the operators it
has a formula for: without these, a forward whose attention runs on ``flash4`` or ``sage`` counts its matmuls alone
(at Wan2.1 14B's 32k tokens, half of the step's FLOPs) and an MFU computed from it reads half what it is. Each
operator counts as SDPA's exact attention of the same shapes (torch's own formulas), which is the work it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count


def register_attention_flops(forward, backward, tokens_first: bool = False) -> None:
    """Formulas for an attention operator and its backward (``torch.ops.<namespace>.<name>``), called as
    ``forward(q, k, v, ...)`` and ``backward(grad_out, q, k, v, ...)``; ``tokens_first``: their tensors are
    [batch, tokens, heads, dim] (FA4's layout), not SDPA's [batch, heads, tokens, dim]."""

    def sdpa_layout(shape: Sequence[int]) -> Sequence[int]:
        return (shape[0], shape[2], shape[1], shape[3]) if tokens_first else shape

    register_flop_formula(forward)(lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(
        sdpa_layout(q), sdpa_layout(k), sdpa_layout(v)))
    register_flop_formula(backward)(lambda grad_out, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
        sdpa_layout(grad_out), sdpa_layout(q), sdpa_layout(k), sdpa_layout(v)))
