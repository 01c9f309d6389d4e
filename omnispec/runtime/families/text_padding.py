"""Prompts at their own lengths: one forward per prompt length among a batch's rows (``per_length``), so no forward
pads a prompt or needs a mask; and, for families whose transformer masks padded text tokens out as keys, the valid
tokens kept in their order (``valid_first``). A mask keeps attention off the flash-class kernels; without the padded
tokens nothing a valid token or an image token computes changes, where the text's rotary positions do not depend on
where a token sits (a family says why that holds for it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch


def valid_first(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's valid tokens (``mask`` true along dim 1) first, in their order, cut to the longest row's count, for
    ``embeds`` of any trailing dims; the mask the same way; and each row's count, on the host (read every step without
    a device sync)."""
    valid = mask.bool()
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    counts = valid.sum(dim=1).cpu()
    order = order[:, :int(counts.max()) if counts.numel() else 0]
    rows = torch.arange(embeds.shape[0], device=embeds.device)[:, None]
    return embeds[rows, order], mask.gather(1, order), counts


def per_length(lengths: Sequence[Hashable], forward: Callable[[torch.Tensor | None, Hashable], torch.Tensor],
               device: torch.device) -> torch.Tensor:
    """The rows' outputs, from one ``forward(index, length)`` per distinct length among them (``index``: the rows
    of that length, on ``device``; None when every row has it), put back in row order."""
    groups: dict[Hashable, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(length, []).append(row)
    if len(groups) == 1:
        return forward(None, next(iter(groups)))
    parts = []
    for length, rows in groups.items():
        index = torch.tensor(rows, device=device)
        parts.append((index, forward(index, length)))
    first = parts[0][1]
    out = first.new_empty((len(lengths), *first.shape[1:]))
    for index, part in parts:
        out[index] = part
    return out
