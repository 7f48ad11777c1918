"""linear_logprobs in plain torch (docs/contract.md, "Log-probs from hidden states"): the passes over a chunk
of logits z [n, V] that the shared chunk loop (vcpo_kernels/head_chunks.py) calls, in z's dtype (float64 for
float64 inputs). Forward: lse = logsumexp(z), logp = z[y] - lse, entropy = lse - sum p z,
sum p^2 = exp(logsumexp(2 z) - 2 lse). Backward, in z's buffer:
    d z = a (onehot(y) - p) - e p (z - E_p[z]) + 2 q p (p - sum p^2),   E_p[z] = lse - entropy.
With a cap c the passes first replace z by c tanh(z / c), and the backward multiplies d z by its derivative
1 - tanh^2(z / c) = cosh(z / c)^-2 (relative even where tanh rounds to +-1)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import head_chunks


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a_tv b_tv per row, without an n x V product in memory."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).reshape(-1)


def logits_forward(z: Tensor, targets: Tensor, ignore_index: int, cap: Optional[float]):
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)  # the chunk's buffer: the loop reads it no more
    keep = targets != ignore_index
    lse = torch.logsumexp(z, -1)
    y = torch.where(keep, targets, 0)
    logp = torch.where(keep, z.gather(-1, y[:, None])[:, 0] - lse, 0)
    p = torch.sub(z, lse[:, None]).exp_()
    entropy = torch.where(keep, lse - _row_dot(p, z), 0)
    sum_p2 = torch.where(keep, _row_dot(p, p), 0)
    return lse, logp, entropy, sum_p2


def logits_backward_(z: Tensor, lse: Tensor, targets: Tensor, ignore_index: int, g_logp: Optional[Tensor],
                     g_entropy: Optional[Tensor], g_sum_p2: Optional[Tensor], entropy: Optional[Tensor],
                     sum_p2: Optional[Tensor], scale: float, cap: Optional[float]) -> Tensor:
    # d z = p * (a0 + a1 z + a2 p) + a [v = y]: formed in z's buffer, so at most two chunks of logits are alive
    # (three with a cap: the tanh's derivative)
    d_cap = None
    if cap is not None:
        d_cap = torch.div(z, cap).cosh_().pow_(-2)
        z.div_(cap).tanh_().mul_(cap)
    p = torch.sub(z, lse[:, None]).exp_()
    a0 = torch.zeros_like(lse)
    if g_logp is not None:
        a0 -= g_logp
    if g_entropy is not None:
        a0 += g_entropy * (lse - entropy)
        z.mul_(-g_entropy[:, None])
    else:
        z.zero_()
    if g_sum_p2 is not None:
        a0 -= 2 * g_sum_p2 * sum_p2
        z.addcmul_(p, 2 * g_sum_p2[:, None])
    dz = z.add_(a0[:, None]).mul_(p)
    keep = targets != ignore_index
    if g_logp is not None:
        dz.scatter_add_(-1, torch.where(keep, targets, 0)[:, None], g_logp[:, None])
    if d_cap is not None:
        dz.mul_(d_cap)
    return dz.mul_(keep.to(dz.dtype)[:, None] * scale)  # ignored targets contribute nothing


ROWS = head_chunks.RowPasses(logits_forward, logits_backward_)


def linear_logprobs(*args):
    return head_chunks.linear_logprobs(ROWS, *args)
