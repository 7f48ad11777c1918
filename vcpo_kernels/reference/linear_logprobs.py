"""Per-token log-probs from hidden states and the LM head without the N x V logits (docs/contract.md,
"Log-probs from hidden states"): the reference, chunked over tokens in torch, in float64 for float64 inputs.

Forward, per chunk of tokens: z = (h W^T + b) / T, lse = logsumexp(z), logp = z[y] - lse, and optionally the
entropy lse - sum p z and sum_v p^2 = exp(logsumexp(2 z) - 2 lse). Only lse [N] is kept for the backward,
which recomputes each chunk's logits and forms
    dz = g_logp (onehot(y) - p) - g_ent p (z - E_p[z]) + 2 g_p2 p (p - sum p^2),   d logits = dz / T.
With `seq_sq_norm` (and `cu_seqlens`), the backward walks the tokens one sequence at a time and adds each
sequence's ||d W_i||^2 + ||d b_i||^2 to it: the exact per-sequence squared norm of the LM head's gradient."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], inv_t: float) -> Tensor:
    z = h @ w.T
    if b is not None:
        z = z + b
    return z * inv_t


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a_tv b_tv per row, without an N x V product in memory."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).reshape(-1)


def _chunks(n: int, cu_seqlens: Optional[Tensor], chunk: int):
    """(start, end, sequence, ends the sequence) spans of at most `chunk` tokens; with cu_seqlens they never
    cross a sequence boundary (read once, here)."""
    if cu_seqlens is None:
        for s in range(0, n, chunk):
            yield s, min(s + chunk, n), None, False
        return
    bounds = cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        for s in range(bounds[i], bounds[i + 1], chunk):
            e = min(s + chunk, bounds[i + 1])
            yield s, e, i, e == bounds[i + 1]


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, ignore_index, chunk, want_entropy, want_p2,
                cu_seqlens, seq_sq_norm):
        dt = _compute_dtype(hidden, weight, bias)
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        n = hidden.shape[0]
        out_dt = torch.float64 if dt == torch.float64 else torch.float32
        logp = torch.zeros(n, dtype=out_dt, device=hidden.device)
        lse = torch.zeros(n, dtype=dt, device=hidden.device)
        entropy = torch.zeros(n, dtype=out_dt, device=hidden.device) if want_entropy else None
        sum_p2 = torch.zeros(n, dtype=out_dt, device=hidden.device) if want_p2 else None
        valid = targets != ignore_index
        for s, e, _, _ in _chunks(n, None, chunk):
            z = _logits(hidden[s:e].to(dt), w, b, inv_t)
            l = torch.logsumexp(z, -1)
            y = torch.where(valid[s:e], targets[s:e], 0)
            keep = valid[s:e]
            lse[s:e] = l
            logp[s:e] = torch.where(keep, z.gather(-1, y[:, None])[:, 0] - l, 0).to(out_dt)
            if want_entropy or want_p2:
                p = torch.sub(z, l[:, None]).exp_()
                if want_entropy:
                    entropy[s:e] = torch.where(keep, l - _row_dot(p, z), 0).to(out_dt)
                if want_p2:
                    sum_p2[s:e] = torch.where(keep, _row_dot(p, p), 0).to(out_dt)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, cu_seqlens, seq_sq_norm)
        ctx.config = (inv_t, ignore_index, chunk)
        return logp, entropy, sum_p2

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_p2):
        hidden, weight, bias, targets, lse, cu_seqlens, seq_sq_norm = ctx.saved_tensors
        inv_t, ignore_index, chunk = ctx.config
        dt = lse.dtype
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # a frozen head or input skips its GEMM
        d_hidden = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=dt, device=bias.device) if need_b else None
        valid = targets != ignore_index
        per_seq = seq_sq_norm is not None
        seq_acc = torch.zeros(seq_sq_norm.shape, dtype=dt) if per_seq else None
        open_seq = None  # (sequence, its d W and d b so far) while a sequence spans several chunks
        for s, e, seq, seq_ends in _chunks(n, cu_seqlens if per_seq else None, chunk):
            h = hidden[s:e].to(dt)
            z = _logits(h, w, b, inv_t)
            # d z = p * (a0 + a1 z + a2 p), formed in z's buffer: at most two chunks of logits alive
            p = torch.sub(z, lse[s:e, None]).exp_()
            a0 = torch.zeros(e - s, 1, dtype=dt, device=z.device)
            if g_logp is not None:
                gl = g_logp[s:e].to(dt)[:, None]
                a0 -= gl
            if g_ent is not None:
                ge = g_ent[s:e].to(dt)[:, None]
                a0 += ge * _row_dot(p, z)[:, None]
                z.mul_(-ge)
            else:
                z.zero_()
            if g_p2 is not None:
                gq = g_p2[s:e].to(dt)[:, None]
                a0 -= 2 * gq * _row_dot(p, p)[:, None]
                z.addcmul_(p, 2 * gq)
            dz = z.add_(a0).mul_(p)
            del p
            if g_logp is not None:
                dz.scatter_add_(-1, torch.where(valid[s:e], targets[s:e], 0)[:, None], gl)
            dz.mul_(valid[s:e].to(dt)[:, None] * inv_t)  # ignored targets contribute nothing
            if need_h:
                torch.mm(dz, w, out=d_hidden[s:e])
            db = dz.sum(0) if bias is not None else None
            if need_b:
                d_bias += db
            if not per_seq:
                if need_w:
                    d_weight.addmm_(dz.T, h)  # no [V, H] temporary
                continue
            dw = dz.T @ h  # this sequence's part, kept for its norm
            if need_w:
                d_weight += dw
            if open_seq is not None and open_seq[0] == seq:  # a sequence longer than a chunk
                dw, db = open_seq[1] + dw, None if db is None else open_seq[2] + db
            if seq_ends:
                seq_acc[seq] = dw.pow(2).sum() + (0 if db is None else db.pow(2).sum())
                open_seq = None
            else:
                open_seq = (seq, dw, db)
        if per_seq:
            seq_sq_norm.add_(seq_acc.to(seq_sq_norm.dtype))
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None, None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
                    ignore_index: int, chunk_size: int, return_entropy: bool, return_sum_p2: bool,
                    cu_seqlens: Optional[Tensor], seq_grad_sq_norm: Optional[Tensor]):
    return _LinearLogprobs.apply(hidden, weight, bias, targets, 1.0 / temperature, ignore_index, chunk_size,
                                 return_entropy, return_sum_p2, cu_seqlens, seq_grad_sq_norm)
