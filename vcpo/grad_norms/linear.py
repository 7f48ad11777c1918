"""Linear layers (nn.Linear, transformers' Conv1D) and their biases: a weight's per-sequence norm
||B_i^T A_i||_F^2 in the ghost form <A_i A_i^T, B_i B_i^T> or materialised, whichever costs fewer FLOPs, and the
gradient sum_i c_i B_i^T A_i as B^T diag(c) A (docs/grad_norms.md)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .fsdp import accumulate
from .layout import SequenceLayout
from .records import Call, Record, acc, chunked


def is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: y = x @ W + b with W [in, out]
    if type(module).__name__ != "Conv1D" or not type(module).__module__.startswith("transformers"):
        return False
    from transformers.pytorch_utils import Conv1D

    return type(module).forward is Conv1D.forward


def ghost_form(t: int, d_in: int, d_out: int, ghost: Optional[bool]) -> bool:
    """Whether a linear layer's norm takes the ghost form: the forced one, else the cheaper in FLOPs."""
    return ghost if ghost is not None else t * (d_in + d_out) <= d_in * d_out


def linear_sq_norms(a: Tensor, b: Tensor, ghost: Optional[bool]) -> Tensor:
    """[B]: ||B_i^T A_i||_F^2 for rows a [B, T, d_in], b [B, T, d_out] (zero rows contribute nothing)."""
    t, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
    if ghost_form(t, d_in, d_out, ghost):  # <A A^T, B B^T>: O(T^2 (d_in + d_out))
        return chunked(lambda a, b: (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(b, b.transpose(1, 2))).sum((1, 2)),
                       a, b, per_seq_elements=2 * t * t)
    # O(T d_in d_out); the norm reads the [d_out, d_in] products once (pow then sum wrote and read them again)
    return chunked(lambda a, b: torch.linalg.vector_norm(torch.bmm(b.transpose(1, 2), a), dim=(1, 2)).square(), a, b,
                   per_seq_elements=d_in * d_out)


def weight_sq_norms(layout: SequenceLayout, rec: Record, call: Call, ghost: Optional[bool]) -> Tensor:
    """[B]: the per-sequence squared norms of a linear call's weight gradient."""
    return linear_sq_norms(acc(layout.rows(call.args[0], rec.name)), acc(layout.rows(call.grads[0], rec.name)), ghost)


def bias_sq_norms(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B]: the per-sequence squared norms of a linear call's bias gradient (the sum of its output gradients)."""
    return acc(layout.rows(call.grads[0], rec.name)).sum(1).pow(2).sum(1)


def form(layout: SequenceLayout, rec: Record, call: Call, ghost: Optional[bool]) -> str:
    """"ghost" or "materialised": the form weight_sq_norms takes for this call."""
    t = layout.rows(call.args[0], rec.name).shape[1]
    return "ghost" if ghost_form(t, call.args[0].shape[-1], call.grads[0].shape[-1], ghost) else "materialised"


def weight_per_seq(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B, *weight.shape]: a linear call's per-sequence weight gradients."""
    g = torch.bmm(acc(layout.rows(call.grads[0], rec.name)).transpose(1, 2), acc(layout.rows(call.args[0], rec.name)))
    return g.transpose(1, 2) if call.kind == "conv1d" else g


def bias_per_seq(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B, d_out]: a linear call's per-sequence bias gradients."""
    return acc(layout.rows(call.grads[0], rec.name)).sum(1)


def assemble(layout: SequenceLayout, rec: Record, call: Call, coefficients: Tensor) -> None:
    """sum_i c_i g_i into a linear call's weight and bias: B^T diag(c) A and c^T B over its rows."""
    m = rec.module
    x, grad = call.args[0], call.grads[0]
    w = layout.row_weights(coefficients, grad, rec.name)  # one weight per row
    g2 = grad.reshape(-1, grad.shape[-1])
    a2 = x.reshape(-1, x.shape[-1])
    if a2.dtype != g2.dtype:  # mixed precision: an fp32 input, a bf16 output gradient; formed in the wider
        dt = torch.promote_types(a2.dtype, g2.dtype)
        a2, g2 = a2.to(dt), g2.to(dt)
    if m.weight.requires_grad:
        # B^T diag(w) A: scale whichever of A and B is narrower (the LM head's B is V wide)
        if a2.shape[1] <= g2.shape[1]:
            a2w, g2w = a2 * w[:, None].to(a2.dtype), g2
        else:
            a2w, g2w = a2, g2 * w[:, None].to(g2.dtype)
        accumulate(m.weight, a2w.T @ g2w if call.kind == "conv1d" else g2w.T @ a2w)
    if m.bias is not None and m.bias.requires_grad:
        accumulate(m.bias, w.to(g2.dtype) @ g2)
