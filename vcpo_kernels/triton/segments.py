"""Segmented reductions over packed sequences of 1 to 128k+ tokens, deterministic (no float atomics).

Each sequence is cut into chunks of CHUNK tokens; one program reduces one chunk to a row of partial sums,
and `combine` adds a sequence's rows in chunk order. A long sequence is thus spread over many programs and
the result never depends on scheduling. The grid needs no host sync: sum_i ceil(L_i / CHUNK) <=
N // CHUNK + B, so that many programs are launched and those past the last chunk return at once; a program
finds its chunk by binary search in the running chunk count (chunk_end)."""

import torch
import triton
import triton.language as tl

CHUNK = 4096  # tokens per program
BLOCK = 1024  # tokens per step inside a program


def chunk_plan(cu_seqlens: torch.Tensor, num_tokens: int, chunk: int = CHUNK):
    """(chunk_end [B] int64: chunks of sequences 0..i, grid: an upper bound of the chunk count,
    search steps for the binary search)."""
    b = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_end = torch.cumsum(torch.div(lengths + chunk - 1, chunk, rounding_mode="floor"), 0)
    return chunk_end, num_tokens // chunk + b, max(b, 1).bit_length() + 1


@triton.jit
def chunk_span(pid, chunk_end_ptr, cu_ptr, num_seqs, num_tokens, search_steps, CHUNK: tl.constexpr):
    """(sequence, first token, end token) of chunk `pid`; sequence == num_seqs past the last chunk. The span
    is clipped to [0, num_tokens): offsets that were not validated cannot make a program read out of bounds."""
    lo = tl.full((), 0, tl.int64)
    hi = tl.full((), 0, tl.int64) + num_seqs
    for _ in range(0, search_steps):  # the first sequence whose chunk_end exceeds pid
        mid = (lo + hi) // 2
        end = tl.load(chunk_end_ptr + mid, mask=mid < hi, other=0)
        right = (mid < hi) & (end <= pid)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = tl.minimum(lo, num_seqs - 1)
    start = tl.load(cu_ptr + seq)
    stop = tl.load(cu_ptr + seq + 1)
    first_chunk = tl.load(chunk_end_ptr + seq) - (stop - start + CHUNK - 1) // CHUNK
    first = start + (pid - first_chunk) * CHUNK
    last = tl.minimum(tl.minimum(first + CHUNK, stop), num_tokens)
    return lo, tl.maximum(first, 0), last


@triton.jit
def _combine(part_ptr, chunk_end_ptr, out_ptr, num_seqs, num_parts, K: tl.constexpr, KP: tl.constexpr):
    # out[k, i] = sum over sequence i's chunks, in chunk order, of part[chunk, k]
    i = tl.program_id(0)
    end = tl.minimum(tl.load(chunk_end_ptr + i), num_parts)
    start = tl.maximum(tl.load(chunk_end_ptr + i - 1, mask=i > 0, other=0), 0)
    k = tl.arange(0, KP)
    acc = tl.zeros((KP,), part_ptr.dtype.element_ty)
    for c in range(start, end):
        acc += tl.load(part_ptr + c * K + k, mask=k < K, other=0.0)
    tl.store(out_ptr + k * num_seqs + i, acc, mask=k < K)


def combine(partials: torch.Tensor, chunk_end: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[K, B]: per-sequence sums of the per-chunk partial rows partials [grid, K]."""
    k = partials.shape[1]
    out = partials.new_empty((k, num_seqs))
    if num_seqs:
        _combine[(num_seqs,)](partials, chunk_end, out, num_seqs, partials.shape[0], K=k,
                              KP=triton.next_power_of_2(k))
    return out


@triton.jit
def counted_deltas(t, last, lp_ptr, mu_ptr, old_ptr, mask_ptr, HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr,
                   ACC64: tl.constexpr):
    """(counted, Delta) of the tokens t of a chunk ending at `last`: Delta = lp_prox - mu in the accumulation
    dtype, 0 where the token does not count (its values are never read)."""
    acc_t = tl.float64 if ACC64 else tl.float32
    counted = t < last
    if HAS_MASK:
        counted = counted & (tl.load(mask_ptr + t, mask=counted, other=0) != 0)
    src = old_ptr if HAS_OLD else lp_ptr
    prox = tl.load(src + t, mask=counted, other=0.0).to(acc_t)
    return counted, tl.where(counted, prox - tl.load(mu_ptr + t, mask=counted, other=0.0).to(acc_t), 0.0)


@triton.jit
def k3_term(d):
    """exp(d) - 1 - d without cancellation: its Taylor series up to d^10 for |d| < 0.1 (relative error below
    1e-16), the direct form elsewhere (>= 0.0048 there)."""
    q = 1.0 / 3628800.0
    q = q * d + 1.0 / 362880.0
    q = q * d + 1.0 / 40320.0
    q = q * d + 1.0 / 5040.0
    q = q * d + 1.0 / 720.0
    q = q * d + 1.0 / 120.0
    q = q * d + 1.0 / 24.0
    q = q * d + 1.0 / 6.0
    q = q * d + 0.5
    return tl.where(tl.abs(d) < 0.1, d * d * q, tl.exp(d) - 1.0 - d)
