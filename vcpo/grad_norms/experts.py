"""Mixture-of-experts layers of transformers (an experts module with 3-D expert weights, dispatched to its eager,
grouped_mm or batched_mm implementation): each expert is two linear layers over the (token, expert) pairs routed to
it, so each expert's norm per sequence takes the ghost or materialised form of a linear layer (docs/grad_norms.md)."""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .layout import SequenceLayout
from .linear import linear_sq_norms
from .records import (Call, Record, UnsupportedModuleError, acc, output_grad, replay_checked, replay_key,
                      replay_matches, replay_passed)


@functools.cache
def _dispatch_code():
    """The code of the forward that transformers' `use_experts_implementation` gives an experts class."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None

    class _Probe(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    return use_experts_implementation(_Probe).forward.__code__


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module: forward(hidden [N, H], expert ids [N, k], routing weights [N, k]) with
    3-D expert weights, dispatched to eager / grouped_mm / batched_mm implementations of one computation."""
    forward = type(module).forward
    if not type(module).__module__.startswith("transformers") or not hasattr(forward, "__wrapped__"):
        return False
    code = _dispatch_code()
    return code is not None and forward.__code__ is code


def _terms(layout: SequenceLayout, rec: Record, call: Call) -> list:
    """A transformers experts module's per-expert terms, formed once per call: [(e, seq, parts)] with parts
    [(weight, dz, input rows, bias)] for its two projections over the (token, expert) pairs routed to e whose
    token received a gradient (the others add nothing to any gradient), and seq the sequence of each pair.

    Token t routed to expert e with weight r: z1 = W1[e] x + b1[e], a = gate(z1), z2 = W2[e] a + b2[e],
    out_t += r z2. So dW2[e] = sum dz2 a^T with dz2 = r dout_t, and dW1[e] = sum dz1 x^T with dz1 the
    gate's vjp of da = W2[e]^T dz2: each expert is two linear layers over its pairs. The output recomputed
    from these terms must match the module's on those tokens: checked once per module and key (replay_key)."""
    if call.terms is not None:
        return call.terms
    m = rec.module
    if getattr(m, "_is_expert_parallel", False):
        raise UnsupportedModuleError(rec.name, "expert-parallel experts")
    try:
        names = list(inspect.signature(type(m).forward.__wrapped__).parameters)[1:4]
        bound = inspect.signature(type(m).forward.__wrapped__).bind(m, *call.args, **call.kwargs).arguments
        x, index, weight = (bound[n] for n in names)
    except (TypeError, KeyError, ValueError):
        raise UnsupportedModuleError(rec.name, "experts called with arguments other than (hidden states, expert "
                                               "ids, routing weights)") from None
    gated = m.has_gate
    w1 = m.gate_up_proj if gated else m.up_proj
    b1 = (m.gate_up_proj_bias if gated else m.up_proj_bias) if m.has_bias else None
    w2, b2 = m.down_proj, (m.down_proj_bias if m.has_bias else None)
    transposed = m.is_transposed  # weights [E, in, out] rather than [E, out, in]
    leaves = tree_flatten((call.args, call.kwargs))[0]
    key = replay_key(rec, call, f"experts, {getattr(m.config, '_experts_implementation', None)}",
                     [j for j, t in enumerate(leaves) if isinstance(t, Tensor)])
    check = not replay_checked(m, key)
    x, dout = acc(x), acc(output_grad(call))
    seq_of_token = layout.row_seq(x, rec.name)
    n, k = index.shape
    token = torch.arange(n, device=x.device).repeat_interleave(k)
    # right padding and masked tokens: zero output gradients, so no pair of theirs contributes (one host read)
    live = dout.ne(0).any(1)[token].nonzero().squeeze(1)
    token, flat_e, route = token[live], index.reshape(-1)[live], acc(weight).reshape(-1)[live]
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=w1.shape[0]).tolist()  # one host read
    replay = torch.zeros_like(x) if check else None
    terms, start = [], 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start:start + count]
        start += count
        tok, r = token[sel], route[sel, None]
        xe = x[tok]
        W1, W2 = acc(w1[e].detach()), acc(w2[e].detach())
        W1, W2 = (W1.T, W2.T) if transposed else (W1, W2)  # as [out, in]
        z1 = xe @ W1.T if b1 is None else xe @ W1.T + acc(b1[e].detach())  # (+ 0 would copy z1)
        with torch.enable_grad():
            z1 = z1.detach().requires_grad_()
            a_graph = m._apply_gate(z1) if gated else m.act_fn(z1)
        a = a_graph.detach()
        if check:
            z2 = a @ W2.T if b2 is None else a @ W2.T + acc(b2[e].detach())
            replay.index_add_(0, tok, z2 * r)
        dz2 = dout[tok] * r
        (dz1,) = torch.autograd.grad(a_graph, z1, dz2 @ W2)
        terms.append((e, seq_of_token[tok], [(w1, dz1, xe, b1), (w2, dz2, a, b2)]))
    if check:
        rows = token.unique()
        if not replay_matches(replay[rows], call.values[0][rows], call):
            raise UnsupportedModuleError(rec.name, f"{type(m).__name__} computes something other than the standard "
                                                   "routed experts (gate/up, activation, down, routing weight)")
        if rows.numel():
            replay_passed(m, key)
    call.terms = terms
    return terms


def _buckets(segment: Tensor, num_segments: int) -> tuple:
    """Where each pair's row goes in zero-padded blocks of segments of similar length, a segment being one
    sequence's pairs routed to one expert: (row of each pair in a flat [rows, d] buffer, rows, [(first row,
    segments, length)] per block). A segment's pairs fill its slot of a block in order; segments are sorted by their
    pair count and a block holds those within 2x of its longest, so padding at most doubles a block (padding every
    sequence to the longest one cost up to 10x on a MoE's skewed routing), and one batched product per block serves
    every expert (their shapes are equal). `segment` must be non-decreasing."""
    per = torch.bincount(segment, minlength=num_segments)
    counts = per.tolist()  # one host read
    blocks, base = [], [0] * num_segments

    def end(block):  # the row after a block
        return block[0] + len(block[1]) * block[2]

    for s in sorted((s for s in range(num_segments) if counts[s]), key=lambda s: -counts[s]):
        if not blocks or 2 * counts[s] < blocks[-1][2]:
            blocks.append((end(blocks[-1]) if blocks else 0, [], counts[s]))
        first, members, length = blocks[-1]
        base[s] = first + len(members) * length
        members.append(s)
    rows = end(blocks[-1]) if blocks else 0
    pos = torch.arange(segment.numel(), device=segment.device) - (torch.cumsum(per, 0) - per)[segment]
    return torch.tensor(base, device=segment.device)[segment] + pos, rows, blocks


def sq_norms(layout: SequenceLayout, rec: Record, call: Call, ghost: Optional[bool]) -> Tensor:
    """[B]: per-sequence squared norms of an experts module's weights: the sum over experts of each expert's
    per-sequence norm, ghost or materialised per block of segments."""
    b = layout.num_seqs
    total = torch.zeros(b, dtype=torch.float64, device=call.values[0].device)
    terms = _terms(layout, rec, call)
    if not terms:
        return total
    num_segments = rec.module.down_proj.shape[0] * b
    # experts in increasing order, each one's pairs in token order: the segment ids never decrease
    segment = torch.cat([e * b + seq for e, seq, _ in terms])
    row, rows, blocks = _buckets(segment, num_segments)
    pairs = list(itertools.accumulate((seq.numel() for _, seq, _ in terms), initial=0))  # each expert's rows
    for j, (w, dz, inp, bias) in enumerate(terms[0][2]):  # the two projections (shapes as the first expert's)
        if w.requires_grad:
            width_a, width_b = inp.shape[1], dz.shape[1]
            flat_a, flat_b = inp.new_zeros(rows, width_a), dz.new_zeros(rows, width_b)
            for k, (_, _, parts) in enumerate(terms):
                flat_a.index_copy_(0, row[pairs[k]:pairs[k + 1]], parts[j][2])
                flat_b.index_copy_(0, row[pairs[k]:pairs[k + 1]], parts[j][1])
            for first, members, length in blocks:
                end = first + len(members) * length
                norms = linear_sq_norms(flat_a[first:end].view(-1, length, width_a),
                                        flat_b[first:end].view(-1, length, width_b), ghost)
                total.index_add_(0, torch.tensor(members, device=total.device) % b, norms.double())
        if bias is not None and bias.requires_grad:
            sums = dz.new_zeros(num_segments, dz.shape[1]).index_add_(0, segment,
                                                                   torch.cat([parts[j][1] for _, _, parts in terms]))
            total.index_add_(0, torch.arange(num_segments, device=total.device) % b, sums.pow(2).sum(1).double())
    return total


def assemble(layout: SequenceLayout, rec: Record, call: Call, coefficients: Tensor) -> None:
    """sum_i c_i g_i into an experts module's weights: (c dz)^T x per expert."""
    transposed = rec.module.is_transposed
    for e, seq, parts in _terms(layout, rec, call):
        for w, dz, inp, bias in parts:
            c = coefficients.to(dz.device, dz.dtype)[seq, None]
            if w.requires_grad:
                gw = (dz * c).T @ inp
                w.grad = torch.zeros_like(w) if w.grad is None else w.grad
                w.grad[e] += (gw.T if transposed else gw).to(w.dtype)
            if bias is not None and bias.requires_grad:
                bias.grad = torch.zeros_like(bias) if bias.grad is None else bias.grad
                bias.grad[e] += (c * dz).sum(0).to(bias.dtype)
