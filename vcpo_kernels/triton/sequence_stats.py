"""Per-sequence sums s_i, L_i, k3_i (docs/contract.md, "Per-sequence statistics") in Triton: one program
per chunk of a sequence, partial rows combined in chunk order (segments.py)."""

import torch
import triton
import triton.language as tl

from ..inputs import TokenBatch
from .segments import BLOCK, CHUNK, chunk_plan, chunk_span, combine, counted_deltas, k3_term


@triton.jit
def _partials(lp_ptr, mu_ptr, old_ptr, mask_ptr, cu_ptr, chunk_end_ptr, part_ptr, num_seqs, num_tokens, search_steps,
              HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr, ACC64: tl.constexpr, CHUNK: tl.constexpr,
              BLOCK: tl.constexpr):
    acc_t = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0)
    seq, first, last = chunk_span(pid, chunk_end_ptr, cu_ptr, num_seqs, num_tokens, search_steps, CHUNK)
    if seq < num_seqs:
        s = tl.zeros((BLOCK,), acc_t)
        length = tl.zeros((BLOCK,), acc_t)
        k3 = tl.zeros((BLOCK,), acc_t)
        for start in range(first, last, BLOCK):
            t = start + tl.arange(0, BLOCK)
            counted, d = counted_deltas(t, last, lp_ptr, mu_ptr, old_ptr, mask_ptr, HAS_OLD, HAS_MASK, ACC64)
            s += d
            length += counted.to(acc_t)
            k3 += tl.where(d == -float("inf"), 0.0, k3_term(d))  # a zero weight (log pi = -inf): left out
        tl.store(part_ptr + pid * 3, tl.sum(s, 0))
        tl.store(part_ptr + pid * 3 + 1, tl.sum(length, 0))
        tl.store(part_ptr + pid * 3 + 2, tl.sum(k3, 0))


def sequence_sums(tokens: TokenBatch):
    """[3, B] (s, L, k3) in the accumulation dtype, and the chunk plan (for the token passes that follow)."""
    t = tokens
    b, n = t.num_seqs, t.logp.numel()
    acc = t.acc_dtype
    chunk_end, grid, steps = chunk_plan(t.cu_seqlens, n)
    partials = torch.zeros((max(grid, 1), 3), dtype=acc, device=t.logp.device)
    if grid and b:
        dummy = t.logp
        _partials[(grid,)](t.logp.detach(), t.behavior_logp.detach(),
                           dummy if t.old_logp is None else t.old_logp.detach(),
                           dummy if t.mask is None else t.mask.view(torch.uint8), t.cu_seqlens, chunk_end, partials,
                           b, n, steps, HAS_OLD=t.old_logp is not None, HAS_MASK=t.mask is not None,
                           ACC64=acc == torch.float64, CHUNK=CHUNK, BLOCK=BLOCK)
    return combine(partials, chunk_end, b), (chunk_end, grid, steps)


def sequence_stats(tokens: TokenBatch):
    sums, _ = sequence_sums(tokens)
    return sums[0], sums[1], sums[2]
