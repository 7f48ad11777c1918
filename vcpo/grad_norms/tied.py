"""A weight with several uses in the forward (an LM head tied to the input embedding, a module called twice): its
per-sequence gradient is the sum of the uses' ones, so its squared norm adds twice each pair's cross term
(docs/grad_norms.md). A use is (kind, record, call), kind the rule of that use of the weight."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import embedding, linear, replay
from .layout import SequenceLayout
from .records import UnsupportedModuleError, acc


def sq_norms(layout: SequenceLayout, uses: list, ghost: Optional[bool]) -> Tensor:
    """||sum_u g_u||^2 over the uses of one weight by embeddings and linear layers (e.g. a tied LM head)."""
    total = sum(_one_use(layout, u, ghost) for u in uses)
    for i in range(len(uses)):
        for j in range(i + 1, len(uses)):
            total = total + 2 * _cross_term(layout, uses[i], uses[j])
    return total


def _one_use(layout: SequenceLayout, use, ghost: Optional[bool]) -> Tensor:
    kind, rec, call = use
    if kind == "embedding":
        return embedding.sq_norms(layout, rec, call)
    return linear.weight_sq_norms(layout, rec, call, ghost)


def _cross_term(layout: SequenceLayout, u, v) -> Tensor:
    """<g_u,i, g_v,i> per sequence, for two uses of one weight."""
    if u[0] == "linear" and v[0] == "embedding":
        u, v = v, u
    if u[0] == "embedding" and v[0] == "linear":
        # g_emb = sum_t e_{x_t} B^emb_t^T; g_lin = B^lin^T A^lin (weight [V, d] as [out, in]):
        # <g_emb, g_lin> = sum_{t,s} B^lin_{s, x_t} <A^lin_s, B^emb_t>.
        _, rec_e, call_e = u
        _, rec_l, call_l = v
        ids = embedding.looked_up_ids(layout, rec_e, call_e)
        b_e = embedding.grad_rows(layout, rec_e, call_e, ids)
        a_l = acc(layout.rows(call_l.args[0], rec_l.name))
        b_l = acc(layout.rows(call_l.grads[0], rec_l.name))
        inner = torch.bmm(a_l, b_e.transpose(1, 2))  # [B, T_l, T_e]: <A_s, B^emb_t>
        picked = torch.gather(b_l, 2, ids.unsqueeze(1).expand(-1, b_l.shape[1], -1))  # B^lin_{s, x_t}
        return (inner * picked).sum((1, 2))
    return (acc(_weight_per_seq(layout, u)) * acc(_weight_per_seq(layout, v))).flatten(1).sum(1)


def _weight_per_seq(layout: SequenceLayout, use) -> Tensor:
    kind, rec, call = use
    return embedding.per_seq(layout, rec, call) if kind == "embedding" else linear.weight_per_seq(layout, rec, call)


def per_seq(layout: SequenceLayout, use, p: Tensor, replayed: dict, replaying) -> Tensor:
    """[B, *p.shape]: the per-sequence gradient of `p` through one use. A replayed module's gradients are formed
    once per call for all its parameters (kept in `replayed`, by id of the call; `replaying` as in replay.per_seq)."""
    kind, rec, call = use
    if kind in ("linear", "conv1d"):
        return linear.weight_per_seq(layout, rec, call)
    if kind == "bias":
        return linear.bias_per_seq(layout, rec, call)
    if kind == "embedding":
        return embedding.per_seq(layout, rec, call)
    if kind == "experts":
        raise UnsupportedModuleError(rec.name, "experts weights shared with another module")
    if id(call) not in replayed:
        replayed[id(call)] = replay.per_seq(layout, rec, call, replaying)
    return replayed[id(call)][id(p)]
