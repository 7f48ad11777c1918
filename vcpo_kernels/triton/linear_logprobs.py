"""The passes over a chunk of logits z [n, V] of linear_logprobs in Triton, one program per row, the row in
blocks of BLOCK columns (math: csrc/cpu/logit_rows.h and docs/contract.md). The forward keeps the running
max m, s = sum e, sx = sum e (z - m) and s2 = sum e^2 with e = exp(z - m), rescaled when m grows, so the row
is read once. With a cap c (HAS_CAP) both passes read each logit as c tanh(z / c), and the backward multiplies
its d z by 1 - tanh^2(z / c) as it writes it. Float arguments reach a compiled kernel as fp32: the scale and
the cap are passed as fp32 pairs hi + lo, exact to about 2^-48, so fp64 rows keep fp64 accuracy."""

import numpy as np
import triton
import triton.language as tl

from .. import head_chunks

_MAX_BLOCK = 4096


def _split(x: float):
    """(hi, lo), both representable in fp32, hi + lo = x to about 2^-48 relative."""
    hi = float(np.float32(x))
    return hi, x - hi


@triton.jit
def _capped(z, cap):
    """(c tanh(z / c), 1 - tanh^2(z / c)), from e = exp(-2 |z / c|): tanh |u| = (1 - e) / (1 + e), within an ulp
    of 1 (so the capped logit within an ulp of c), and 1 - tanh^2 = 4 e / (1 + e)^2, relative even where tanh
    rounds to +-1. NaN stays NaN."""
    e = tl.exp(-2 * tl.abs(z / cap))
    inv = 1 / (1 + e)
    t = (1 - e) * inv
    return tl.where(z < 0, -t, t) * cap, 4 * e * inv * inv


@triton.jit
def _rows_forward(z_ptr, y_ptr, lse_ptr, logp_ptr, ent_ptr, p2_ptr, vocab, ignore_index, cap_hi, cap_lo,
                  HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * vocab
    dt = z_ptr.dtype.element_ty
    cap = tl.zeros((), dt) + cap_hi + cap_lo  # in dt (fp32 scalars promote)
    m = tl.full((), float("-inf"), dt)
    s = tl.zeros((), dt)
    sx = tl.zeros((), dt)
    s2 = tl.zeros((), dt)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        z = tl.load(z_row + cols, mask=inside, other=float("-inf"))
        if HAS_CAP:
            z = tl.where(inside, _capped(z, cap)[0], float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        # rescale the sums kept relative to m; while m is still -inf they are 0 (and the factor is NaN)
        shift = tl.where(m == float("-inf"), 0.0, m - m_new).to(dt)
        f = tl.where(m == float("-inf"), 0.0, tl.exp(shift)).to(dt)
        sx = f * (sx + s * shift)
        s = f * s
        s2 = f * f * s2
        x = tl.where(inside, z - m_new, 0.0)
        e = tl.where(inside, tl.exp(x), 0.0)
        s += tl.sum(e, 0)
        sx += tl.sum(e * x, 0)
        s2 += tl.sum(e * e, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    y = tl.load(y_ptr + row)
    counts = y != ignore_index
    z_y = tl.load(z_row + tl.where(counts, y, 0))
    if HAS_CAP:
        z_y = _capped(z_y, cap)[0]
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.where(counts, z_y - lse, 0.0))
    tl.store(ent_ptr + row, tl.where(counts, log_s - sx / s, 0.0))
    tl.store(p2_ptr + row, tl.where(counts, s2 / (s * s), 0.0))


@triton.jit
def _rows_backward(z_ptr, y_ptr, lse_ptr, gl_ptr, ge_ptr, gq_ptr, ent_ptr, p2_ptr, vocab, ignore_index, scale_hi,
                   scale_lo, cap_hi, cap_lo, HAS_GL: tl.constexpr, HAS_GE: tl.constexpr, HAS_GQ: tl.constexpr,
                   HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    # d z = p (c0 + a1 x + a2 p) + a [v = y], x = z - lse, c0 = -a - e H - 2 q S2, a1 = -e, a2 = 2 q; * scale
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * vocab
    dt = z_ptr.dtype.element_ty
    scale = tl.zeros((), dt) + scale_hi + scale_lo
    cap = tl.zeros((), dt) + cap_hi + cap_lo  # in dt (fp32 scalars promote)
    y = tl.load(y_ptr + row)
    keep = y != ignore_index
    a = tl.load(gl_ptr + row) if HAS_GL else tl.zeros((), dt)
    c0 = -a
    a1 = tl.zeros((), dt)
    a2 = tl.zeros((), dt)
    if HAS_GE:
        e = tl.load(ge_ptr + row)
        c0 -= e * tl.load(ent_ptr + row)
        a1 = -e
    if HAS_GQ:
        q = tl.load(gq_ptr + row)
        c0 -= 2 * q * tl.load(p2_ptr + row)
        a2 = 2 * q
    lse = tl.load(lse_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        z = tl.load(z_row + cols, mask=inside, other=0.0)
        if HAS_CAP:
            z, d_cap = _capped(z, cap)
        x = z - lse
        p = tl.exp(x)
        dz = p * (c0 + a1 * x + a2 * p) + tl.where(cols == y, a, 0.0)
        if HAS_CAP:
            dz *= d_cap
        tl.store(z_row + cols, tl.where(keep, dz * scale, 0.0).to(dt), mask=inside)


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(max(vocab, 1)), _MAX_BLOCK)


def _forward(z, targets, ignore_index, cap):
    n, vocab = z.shape
    out = [z.new_empty(n) for _ in range(4)]
    if n:
        _rows_forward[(n,)](z, targets, *out, vocab, ignore_index, *_split(cap or 1.0), HAS_CAP=cap is not None,
                            BLOCK=_block(vocab))
    return tuple(out)


def _backward_(z, lse, targets, ignore_index, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, scale, cap):
    n, vocab = z.shape
    if n:
        dummy = lse  # never read: the HAS_* flags drop the loads
        _rows_backward[(n,)](z, targets, lse, *(dummy if t is None else t for t in
                                                (g_logp, g_entropy, g_sum_p2, entropy, sum_p2)),
                             vocab, ignore_index, *_split(scale), *_split(cap or 1.0), HAS_GL=g_logp is not None,
                             HAS_GE=g_entropy is not None, HAS_GQ=g_sum_p2 is not None, HAS_CAP=cap is not None,
                             BLOCK=_block(vocab))
    return z


ROWS = head_chunks.RowPasses(_forward, _backward_)


def linear_logprobs(*args):
    """The shared chunk loop around torch's GEMMs with the Triton passes over each chunk of logits."""
    return head_chunks.linear_logprobs(ROWS, *args)
