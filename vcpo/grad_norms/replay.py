"""Any other module with parameters: its per-sequence gradients by a vjp of the module replayed on each sequence's
part of its recorded inputs (under vmap, else in a loop), checked against what it output on the batch (a vmap or
whole-call replay once per module and records.replay_key, the loop every time); its weighted gradient
sum_i c_i g_i by one vjp of the whole call (docs/grad_norms.md)."""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layout import SequenceLayout
from .records import (Call, Record, UnsupportedModuleError, call_params, floats, replay_checked, replay_key,
                      replay_matches, replay_passed, tells_sequences_apart)


def _replayable(layout: SequenceLayout, rec: Record, call: Call):
    """(params, run, leaves, batched, live) to replay a module: run(params, inputs) calls it with the recorded
    arguments, the tensors at positions `batched` of the flattened arguments replaced by `inputs`, and returns
    its floating-point outputs that received a gradient, those at positions `live` of call.values."""
    m = rec.module
    params = {n: call.weights.get(n, p).detach() for n, p in call_params(rec, call).items()}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    if layout.cu_seqlens is None:
        batched = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and layout.per_seq(t) is not None]
    else:
        batched = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and layout.token_dim(t) is not None]

    def run(ps, inputs):
        full = list(leaves)
        for j, t in zip(batched, inputs):
            full[j] = t
        args, kwargs = tree_unflatten(full, spec)
        # tie_weights=False: a parameter also owned by a child (BERT's decoder bias) is replaced only where this
        # module uses it itself (or as an adopted child's parameter); the child's uses are its own record's
        outs = floats(torch.func.functional_call(m, ps, args, kwargs, tie_weights=False))
        return tuple(outs[k] for k in live) if len(outs) == len(call.values) else tuple(outs)

    live = [k for k, g in enumerate(call.grads) if g is not None]  # the others add nothing to the vjp
    return params, run, leaves, batched, live


def _per_seq_parts(layout: SequenceLayout, x: Tensor, rec: Record):
    """Padded: (x as [B, r, ...], vmap dim 0). Packed: (x with a unit dimension after the token one, so each
    token keeps x's rank, and the token dimension to vmap over)."""
    if layout.cu_seqlens is None:
        return layout.seq_major(x, rec.name), 0
    d = layout.token_dim(x)
    if d is None:
        raise UnsupportedModuleError(rec.name, f"it returned shape {tuple(x.shape)}, not laid out by packed token")
    return x.unsqueeze(d + 1), d


def per_seq(layout: SequenceLayout, rec: Record, call: Call, replaying) -> dict:
    """{id(param): [B, *shape]}: the per-sequence gradients of a module's own parameters, by a vjp of the
    module replayed under vmap over sequences (padded) or tokens (packed, for modules that act on each token
    separately), else in a loop over sequences; every replay must reproduce the module's recorded output (checked
    the first time for its key, records.replay_key; the loop checks every time).
    `replaying()`: a context in which the recorder does not record the replays."""
    from torch.func import vjp, vmap

    params, run, leaves, batched, live = _replayable(layout, rec, call)
    values, cotangents = [call.values[k] for k in live], [call.grads[k] for k in live]
    ins = [_per_seq_parts(layout, leaves[j], rec) for j in batched]
    outs = [_per_seq_parts(layout, v, rec) for v in values]
    # checked once per module, way of replay and key (records.replay_key); the loop below checks every time
    key = replay_key(rec, call, "vmap per sequence" if layout.cu_seqlens is None else "vmap per token", batched)
    checked = replay_checked(rec.module, key)

    def one(inputs, cots):
        replay, pullback = vjp(lambda ps: run(ps, inputs), params)
        return replay, pullback(tuple(cots))[0]

    with replaying():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # vmap's "no batching rule, falling back" performance warnings
                replay, grads = vmap(one, in_dims=([d for _, d in ins], [d for _, d in outs]), out_dims=(
                    tuple(d for _, d in outs), 0))([t for t, _ in ins],
                                                    [_per_seq_parts(layout, c, rec)[0] for c in cotangents])
            ok = len(replay) == len(outs) and all(r.shape == t.shape if checked else replay_matches(r, t, call)
                                                  for r, (t, _) in zip(replay, outs))
        except Exception:  # data-dependent control flow, ops vmap cannot batch: replay sequence by sequence
            ok = False
        if ok and not checked and tells_sequences_apart(ins):
            replay_passed(rec.module, key)
        if ok and layout.cu_seqlens is not None:  # per token: sum each sequence's tokens
            seq = layout.token_seq(next(iter(grads.values())).device) if grads else None
            grads = {n: g.new_zeros((layout.num_seqs, *g.shape[1:])).index_add_(0, seq, g) for n, g in grads.items()}
        if not ok:
            grads = _per_seq_loop(layout, rec, call, params, run, [leaves[j] for j in batched], values, cotangents)
    objs = call_params(rec, call)
    return {id(objs[n]): g for n, g in grads.items()}


def _per_seq_loop(layout: SequenceLayout, rec: Record, call: Call, params, run, inputs, values, cotangents) -> dict:
    from torch.func import vjp

    per = defaultdict(list)
    for i in range(layout.num_seqs):
        try:
            replay, pullback = vjp(lambda ps: run(ps, [layout.slice(x, i) for x in inputs]), params)
        except Exception as err:  # e.g. a packed attention mask over all tokens, given one sequence's rows
            raise UnsupportedModuleError(rec.name, f"replaying {type(rec.module).__name__} on one sequence "
                                                   f"failed ({type(err).__name__}: {err})") from err
        if len(replay) != len(values) or not all(
                replay_matches(r, layout.slice(v, i), call) for r, v in zip(replay, values)):
            raise UnsupportedModuleError(rec.name, f"{type(rec.module).__name__} replayed on one sequence does "
                                                   "not reproduce its output on the batch (it mixes sequences, is "
                                                   "random, e.g. dropout in train mode, or its inputs are not "
                                                   "laid out by sequence)")
        for n, g in pullback(tuple(layout.slice(c, i) for c in cotangents))[0].items():
            per[n].append(g)
    return {n: torch.stack(gs) for n, gs in per.items()}


def weighted(layout: SequenceLayout, rec: Record, call: Call, coefficients: Tensor, replaying) -> dict:
    """{name: sum_i c_i g_i} for a module's own parameters: one vjp of the whole call, each output row's
    gradient scaled by its sequence's coefficient."""
    from torch.func import vjp

    params, run, leaves, batched, live = _replayable(layout, rec, call)
    values, cots = [call.values[k] for k in live], []
    for k in live:
        g = call.grads[k]
        c = coefficients.to(g.device, g.dtype)
        if layout.cu_seqlens is None:  # [B r, ...]: r leading rows per sequence
            layout.seq_major(g, rec.name)
            w = c.repeat_interleave(g.shape[0] // layout.num_seqs).view(-1, *[1] * (g.dim() - 1))
        else:  # tokens along one dimension
            d = layout.token_dim(g)
            layout.seq_major(g, rec.name)
            w = c[layout.token_seq(g.device)].view(*[1] * d, -1, *[1] * (g.dim() - d - 1))
        cots.append(g * w)
    with replaying():
        replay, pullback = vjp(lambda ps: run(ps, [leaves[j] for j in batched]), params)
    # an output broadcast to every row by the forward hook is replayed as the module's one shared row
    cots = [c.sum(0, keepdim=True) if r.shape[0] == 1 and c.shape[0] > 1 else c for r, c in zip(replay, cots)]
    wants = [v[:1] if r.shape[0] == 1 else v for r, v in zip(replay, values)]
    # the same inputs as the forward: only randomness fails this check, so any batch can pass it for good
    key = replay_key(rec, call, "whole call, " + ("padded" if layout.cu_seqlens is None else "packed"), batched)
    checked = replay_checked(rec.module, key)
    if not all(r.shape == v.shape if checked else replay_matches(r, v, call) for r, v in zip(replay, wants)):
        raise UnsupportedModuleError(rec.name, "replaying it does not reproduce its output (random?)")
    if not checked:
        replay_passed(rec.module, key)
    return pullback(tuple(cots))[0]
