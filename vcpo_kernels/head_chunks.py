"""The chunk loop of linear_logprobs (docs/contract.md, "Log-probs from hidden states"), shared by every
backend: the GEMMs are torch's (BLAS, cuBLAS); a backend supplies the two passes over a chunk's logits
z [n, V] as RowPasses:

    forward(z, targets, ignore_index, cap) -> (lse, logp, entropy, sum_p2)   [n] each, z's dtype
    backward_(z, lse, targets, ignore_index, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, scale, cap) -> z

the second overwriting z with d z * scale (0 on ignored rows). The loop hands them z = (h W^T + b) / T; with a
softcap c the passes read each logit as (c / T) tanh(z / (c / T)) = c tanh((h W^T + b) / c) / T, so `cap` is
c / T (None: no cap), and the backward's d z is chain-ruled through the tanh in the pass that writes it. The
forward keeps lse (and the entropy and sum p^2 when they are outputs, which the backward's d z needs); the
backward recomputes each chunk's logits. With per-sequence norms the backward walks the tokens a sequence at a
time (spans never cross a sequence).

With top-k / top-p sampling (`truncation`) the loop itself reads the logits (capping them first), restricts each
row to its sampling support (vcpo_kernels/truncation.py) by reading the logits outside it as far below the
row's largest, and hands the passes no cap: their lse, entropy and sum p^2 are those of the truncated distribution.
A target outside its row's support has log-prob -inf and no gradient (docs/contract.md, "Truncated sampling")."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .truncation import sampling_support

# A logit outside the sampling support is read as its row's largest minus this: its exp is 0 in fp64 too, and it
# times any finite upstream gradient stays finite (a -inf would give 0 * inf = NaN in the passes' sums).
_OUTSIDE_SUPPORT = 2.0 ** 17


class RowPasses(NamedTuple):
    forward: Callable
    backward_: Callable


def compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """fp64 when any input is fp64, else fp32: the logits and their reductions are formed in it."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], inv_t: float) -> Tensor:
    z = torch.mm(h, w.T) if b is None else torch.addmm(b, h, w.T)
    return z.mul_(inv_t) if inv_t != 1.0 else z


def _truncate(z: Tensor, targets: Tensor, ignore_index: int, cap: Optional[float], truncation: tuple,
              slope: bool):
    """(z capped and restricted to the sampling support, whether each row's target is inside it (an ignored one
    counts as inside), d capped / d z or None): z's buffer is reused."""
    d_cap = torch.div(z, cap).cosh_().pow_(-2) if cap is not None and slope else None
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
    keep = sampling_support(z, *truncation)
    ignored = targets == ignore_index
    inside = keep.gather(1, torch.where(ignored, 0, targets)[:, None])[:, 0] | ignored
    floor = z.amax(1, keepdim=True) - _OUTSIDE_SUPPORT
    return torch.where(keep, z, floor), inside, d_cap


def _spans(n: int, bounds: Optional[list], chunk: int):
    """(start, end, sequence, ends the sequence) spans of at most `chunk` tokens; with sequence bounds they
    never cross a sequence boundary."""
    if bounds is None:
        for s in range(0, n, chunk):
            yield s, min(s + chunk, n), None, False
        return
    for i in range(len(bounds) - 1):
        for s in range(bounds[i], bounds[i + 1], chunk):
            e = min(s + chunk, bounds[i + 1])
            yield s, e, i, e == bounds[i + 1]


class ChunkedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, hidden, weight, bias, targets, inv_t, cap, truncation, ignore_index, chunk, want_entropy,
                want_p2, cu_seqlens, seq_sq_norm, row_ids, seq_rows):
        dt = compute_dtype(hidden, weight, bias)
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        n = hidden.shape[0]
        lse, logp = hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=dt)
        entropy = hidden.new_empty(n, dtype=dt) if want_entropy else None
        sum_p2 = hidden.new_empty(n, dtype=dt) if want_p2 else None
        for s, e, _, _ in _spans(n, None, chunk):
            z = _logits(hidden[s:e].to(dt), w, b, inv_t)
            if truncation is None:
                l, lp, ent, p2 = rows.forward(z, targets[s:e], ignore_index, cap)
            else:
                z, inside, _ = _truncate(z, targets[s:e], ignore_index, cap, truncation, slope=False)
                l, lp, ent, p2 = rows.forward(z, targets[s:e], ignore_index, None)
                lp = lp.masked_fill(~inside, -torch.inf)
            lse[s:e], logp[s:e] = l, lp
            if want_entropy:
                entropy[s:e] = ent
            if want_p2:
                sum_p2[s:e] = p2
        ctx.rows = rows
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, sum_p2)
        # the per-sequence accumulators are written by the backward: kept outside autograd's version checks
        ctx.per_seq = (cu_seqlens, seq_sq_norm, row_ids, seq_rows)
        ctx.config = (inv_t, cap, truncation, ignore_index, chunk)
        ctx.mark_non_differentiable(lse)
        return logp, entropy, sum_p2

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_p2):
        hidden, weight, bias, targets, lse, entropy, sum_p2 = ctx.saved_tensors
        cu_seqlens, seq_sq_norm, row_ids, seq_rows = ctx.per_seq
        inv_t, cap, truncation, ignore_index, chunk = ctx.config
        dt = lse.dtype
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]  # a frozen head or input skips its GEMM
        d_hidden = hidden.new_empty(hidden.shape, dtype=dt) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=dt, device=bias.device) if need_b else None
        # Per-sequence outputs are added by the first backward only: a later one (the loss's, after a norm
        # pass through the same graph) needs the summed gradients alone.
        per_seq = (seq_sq_norm is not None or seq_rows is not None) and not getattr(ctx, "per_seq_done", False)
        ctx.per_seq_done = True
        bounds = cu_seqlens.tolist() if per_seq else None  # one host read of the sequence bounds
        grads = [None if g is None else g.to(dt).contiguous() for g in (g_logp, g_ent, g_p2)]
        open_seq = None  # (sequence, its d W and d b so far) while a sequence spans several chunks
        for s, e, seq, seq_ends in _spans(n, bounds, chunk):
            h = hidden[s:e].to(dt)
            z = _logits(h, w, b, inv_t)
            g_chunk = [None if g is None else g[s:e] for g in grads]
            row_cap, d_cap = cap, None
            if truncation is not None:
                z, inside, d_cap = _truncate(z, targets[s:e], ignore_index, cap, truncation, slope=True)
                row_cap = None
                if g_chunk[0] is not None:  # a target outside the support: log-prob -inf, no gradient
                    g_chunk[0] = g_chunk[0].masked_fill(~inside, 0)
            dz = ctx.rows.backward_(
                z, lse[s:e], targets[s:e], ignore_index, *g_chunk,
                None if entropy is None else entropy[s:e], None if sum_p2 is None else sum_p2[s:e], inv_t, row_cap)
            if d_cap is not None:
                dz.mul_(d_cap)
            if need_h:
                torch.mm(dz, w, out=d_hidden[s:e])
            db = dz.sum(0) if bias is not None and (need_b or per_seq) else None
            if need_b:
                d_bias += db
            if need_w:
                d_weight.addmm_(dz.T, h)  # no [V, H] temporary
            if not per_seq:
                continue
            if seq_rows is not None:  # rows of the sequence's d W (linear: added span by span)
                seq_rows[seq] += (dz[:, row_ids[seq]].T @ h).to(seq_rows.dtype)
            if seq_sq_norm is None:
                continue
            continues = open_seq is not None and open_seq[0] == seq  # a sequence longer than a chunk
            if seq_ends and not continues and (e - s) * (dz.shape[1] + h.shape[1]) <= dz.shape[1] * h.shape[1]:
                # the sequence in one span, short next to V and H: ||dz^T h||^2 = <dz dz^T, h h^T>, no [V, H]
                sq = ((dz @ dz.T) * (h @ h.T)).sum()
            else:  # its d W materialised, carried across the spans of a sequence longer than a chunk
                dw = dz.T @ h
                if continues:
                    dw, db = open_seq[1].add_(dw), None if db is None else open_seq[2].add_(db)
                if not seq_ends:
                    open_seq = (seq, dw, db)
                    continue
                sq = dw.pow(2).sum()
            open_seq = None
            sq = sq + (0 if db is None else db.pow(2).sum())
            seq_sq_norm[seq] += sq.to(seq_sq_norm.dtype)
        return (None,
                None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype)) + (None,) * 12


def linear_logprobs(rows: RowPasses, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
                    temperature: float, softcap: Optional[float], truncation: Optional[tuple], ignore_index: int,
                    chunk_size: int, return_entropy: bool, return_sum_p2: bool, cu_seqlens: Optional[Tensor],
                    seq_grad_sq_norm: Optional[Tensor], seq_grad_row_ids: Optional[Tensor],
                    seq_grad_rows: Optional[Tensor]):
    """(logp, entropy or None, sum_p2 or None) in the compute dtype, with `rows` the backend's passes;
    `truncation`: (top_k, top_p) of truncated sampling, or None."""
    cap = None if softcap is None else softcap / temperature
    return ChunkedLinearLogprobs.apply(rows, hidden, weight, bias, targets, 1.0 / temperature, cap, truncation,
                                       ignore_index,
                                       chunk_size, return_entropy, return_sum_p2, cu_seqlens, seq_grad_sq_norm,
                                       seq_grad_row_ids, seq_grad_rows)
