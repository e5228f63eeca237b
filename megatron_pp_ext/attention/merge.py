"""Merging partial attentions over disjoint key ranges by their log-sum-exp.

If ``(out_i, lse_i)`` is attention over key range i, attention over all ranges is
``sum_i exp(lse_i - L) * out_i`` with ``L = logsumexp_i(lse_i)``. Ranges a query cannot see have
lse -inf and weigh nothing; a query that sees no key at all keeps out 0 and lse -inf. Written
with plain differentiable ops and no NaN in the gradient for those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge ``[(out [..., s, d], lse [..., s]), ...]`` into one ``(out, lse)``.

    The sum is done in the lse dtype (fp32 or fp64); out comes back in the first part's dtype.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one (out, lse) pair")
    if len(parts) == 1:
        return parts[0]
    out_dtype = parts[0][0].dtype
    lses = torch.stack([lse for _, lse in parts])
    peak = lses.detach().amax(dim=0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.exp(lses - peak).sum(dim=0)
    seen = total > 0
    lse = torch.where(seen, peak + torch.log(torch.where(seen, total, torch.ones_like(total))), -torch.inf)
    base = torch.where(seen, lse, torch.zeros_like(lse))
    out = sum(
        torch.exp(part_lse - base).unsqueeze(-1) * part_out.to(lse.dtype) for part_out, part_lse in parts
    )
    return out.to(out_dtype), lse
