"""The support of top-k / top-p (nucleus) sampling, decided from the logits as vLLM decides it (docs/contract.md,
"Truncated sampling"). top-k keeps every logit >= the k-th largest of its row (ties at the edge are all kept);
top-p then drops, from the distribution top-k left, the least likely tokens for as long as the mass dropped stays
<= 1 - p, ascending, the most likely token always kept. Off: top_k -1 or 0 (or >= V), top_p 1."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# the support's temporaries (a sort's values and int64 indices) are formed this many logits at a time
_CHUNK_LOGITS = 1 << 22


def check_sampling(top_k, top_p) -> None:
    """Refuses a top_k that is not an integer >= -1 or a top_p outside (0, 1], naming the value."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k must be an integer >= 1, or -1 or 0 for off, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], 1 for off, got {top_p!r}")


def truncates(top_k: int, top_p: float, vocab: Optional[int] = None) -> bool:
    """Whether sampling with these settings draws from a truncated support (a top_k >= the vocabulary's size, where
    it is given, truncates nothing)."""
    return (top_k > 0 and (vocab is None or top_k < vocab)) or top_p < 1


def sampling_support(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """[..., V] bool: the tokens that sampling from softmax(z) with top_k, then top_p, can draw. z is read in fp32
    at least, without its gradient; rows are formed a chunk at a time (no host sync)."""
    flat = z.detach().reshape(-1, z.shape[-1])
    keep = torch.empty(flat.shape, dtype=torch.bool, device=z.device)
    rows = max(1, _CHUNK_LOGITS // max(flat.shape[1], 1))
    for s in range(0, flat.shape[0], rows):
        keep[s:s + rows] = _rows_support(flat[s:s + rows].to(torch.promote_types(z.dtype, torch.float32)),
                                         top_k, top_p)
    return keep.view(z.shape)


def _rows_support(z: Tensor, top_k: int, top_p: float) -> Tensor:
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    if 0 < top_k < z.shape[1]:
        keep = z >= torch.topk(z, top_k, dim=1).values[:, -1:]
    if top_p < 1:
        ascending, order = torch.sort(z.masked_fill(~keep, -torch.inf), dim=1, stable=True)
        mass_up_to = ascending.softmax(1).cumsum_(1)  # the mass of this token and every less likely one
        dropped = mass_up_to <= 1 - top_p
        dropped[:, -1] = False
        keep &= ~torch.empty_like(dropped).scatter_(1, order, dropped)
    return keep
