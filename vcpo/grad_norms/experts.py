"""Mixture-of-experts layers of transformers (an experts module with 3-D expert weights, dispatched to its eager,
grouped_mm or batched_mm implementation): each expert is two linear layers over the (token, expert) pairs routed to
it, so each expert's norm per sequence takes the ghost or materialised form of a linear layer (docs/grad_norms.md)."""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor, nn

from .layout import SequenceLayout
from .linear import linear_sq_norms
from .records import Call, Record, UnsupportedModuleError, acc, output_grad, replay_matches


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
    [(weight, dz, input rows, bias)] for its two projections over the (token, expert) pairs routed to e, and
    seq the sequence of each pair.

    Token t routed to expert e with weight r: z1 = W1[e] x + b1[e], a = gate(z1), z2 = W2[e] a + b2[e],
    out_t += r z2. So dW2[e] = sum dz2 a^T with dz2 = r dout_t, and dW1[e] = sum dz1 x^T with dz1 the
    gate's vjp of da = W2[e]^T dz2: each expert is two linear layers over its pairs. The output recomputed
    from these terms must match the module's."""
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
    x, dout = acc(x), acc(output_grad(call))
    seq_of_token = layout.row_seq(x, rec.name)
    n, k = index.shape
    flat_e = index.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=w1.shape[0]).tolist()  # one host read
    token = torch.arange(n, device=x.device).repeat_interleave(k)
    route = acc(weight).reshape(-1)
    replay = torch.zeros_like(x)
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
        z1 = xe @ W1.T + (acc(b1[e].detach()) if b1 is not None else 0)
        with torch.enable_grad():
            z1 = z1.detach().requires_grad_()
            a_graph = m._apply_gate(z1) if gated else m.act_fn(z1)
        a = a_graph.detach()
        z2 = a @ W2.T + (acc(b2[e].detach()) if b2 is not None else 0)
        replay.index_add_(0, tok, z2 * r)
        dz2 = dout[tok] * r
        (dz1,) = torch.autograd.grad(a_graph, z1, dz2 @ W2)
        terms.append((e, seq_of_token[tok], [(w1, dz1, xe, b1), (w2, dz2, a, b2)]))
    if not replay_matches(replay, call.values[0], call):
        raise UnsupportedModuleError(rec.name, f"{type(m).__name__} computes something other than the standard "
                                               "routed experts (gate/up, activation, down, routing weight)")
    call.terms = terms
    return terms


def sq_norms(layout: SequenceLayout, rec: Record, call: Call, ghost: Optional[bool]) -> Tensor:
    """[B]: per-sequence squared norms of an experts module's weights, per expert ghost or materialised."""
    total = torch.zeros(layout.num_seqs, dtype=torch.float64, device=call.values[0].device)
    for _, seq, parts in _terms(layout, rec, call):
        # rows of each sequence's pairs, zero-padded: [B, L, d] with L the most pairs a sequence sent here
        per = torch.bincount(seq, minlength=layout.num_seqs)
        pos = torch.arange(seq.numel(), device=seq.device) - (torch.cumsum(per, 0) - per)[seq]
        length = int(per.max())
        for w, dz, inp, bias in parts:
            if w.requires_grad:
                rows_a = inp.new_zeros(layout.num_seqs, length, inp.shape[1]).index_put_((seq, pos), inp)
                rows_b = dz.new_zeros(layout.num_seqs, length, dz.shape[1]).index_put_((seq, pos), dz)
                total += linear_sq_norms(rows_a, rows_b, ghost).double()
            if bias is not None and bias.requires_grad:
                total += dz.new_zeros(layout.num_seqs, dz.shape[1]).index_add_(0, seq, dz).pow(2).sum(1).double()
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
