"""What the recorder keeps of a module's forward and backward (its calls), and what every rule shares: the refusal,
the accumulation dtype, chunking of per-sequence temporaries, the check of a replay against the recorded output."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten


class UnsupportedModuleError(ValueError):
    """The per-sequence gradients of `module` (its name in the model) cannot be formed exactly."""

    def __init__(self, module: str, reason: str):
        super().__init__(f"module {module!r}: {reason}. Exact per-sequence norms are not available for this model: "
                         "use grad_norms='auto' (the LM head's norm, with a warning) or 'lm_head', 'length', 'uniform'")
        self.module = module


@dataclass
class Call:
    """One call of a recorded module in the forward."""

    kind: str  # "linear" | "conv1d" | "embedding" | "experts" | "generic"
    args: tuple  # detached
    kwargs: dict
    outputs: list  # where each floating-point output's gradient arrives (see backward()), until it does
    values: list  # their detached values (replayed modules: the replay is checked against them)
    grads: list  # their gradients, None until (unless) one arrives
    adopted: dict = field(default_factory=dict)  # relative name -> a descendant's parameter this call used itself
    weights: dict = field(default_factory=dict)  # sharded model: name -> a copy of the unsharded value it used
    versions: list = field(default_factory=list)  # (tensor, version) of the kept inputs and outputs
    terms: Optional[list] = None  # experts: the per-expert terms, shared by the norms and the assembly


@dataclass
class Record:
    module: nn.Module
    name: str
    rule: str
    path: str  # the module's name in the model ("" for the model itself)
    calls: list = field(default_factory=list)
    adopted: dict = field(default_factory=dict)  # adopted by the call in progress


def call_params(rec: Record, call: Call) -> dict:
    """{name relative to the module: trainable parameter} replayed for a call: its own and adopted ones."""
    own = {n: p for n, p in rec.module.named_parameters(recurse=False) if p.requires_grad}
    return {**own, **{n: p for n, p in call.adopted.items() if p.requires_grad}}


def output_grad(call: Call, k: int = 0) -> Tensor:
    """The gradient of the call's k-th floating-point output (zeros where none arrived)."""
    g = call.grads[k]
    return g if g is not None else torch.zeros_like(call.values[k])


def acc(x: Tensor) -> Tensor:
    """x in its accumulation dtype: fp32 for fp32/bf16/fp16 records, fp64 for fp64 ones."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def floats(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.is_floating_point()]


# Per-sequence temporaries ([chunk, d_out, d_in] or [chunk, T, T]) are formed a few sequences at a time.
_CHUNK_ELEMENTS = 1 << 24


def chunked(fn, *tensors: Tensor, per_seq_elements: int) -> Tensor:
    """fn over slices of the leading (sequence) dimension, concatenated: bounds the temporaries' memory."""
    step = max(1, _CHUNK_ELEMENTS // max(per_seq_elements, 1))
    n = tensors[0].shape[0]
    return torch.cat([fn(*(t[i:i + step] for t in tensors)) for i in range(0, n, step)]) if n else fn(*tensors)


# A replay of a module on one sequence must reproduce what it output on the batch (same parameters, same
# inputs): a looser match means it mixes sequences or is random, and its per-sequence gradients are refused.
_REPLAY_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def replay_matches(got: Tensor, want: Tensor, call: Call) -> bool:
    """got == want to the precision of the call's least precise floating-point tensor (a float64 module may take
    float32 routing weights and round its output to them, as NemotronH's experts do)."""
    if got.shape != want.shape:
        return False
    if want.numel() == 0:
        return True
    dtypes = [t.dtype for t, _ in call.versions if t.is_floating_point()] + [want.dtype]
    rtol = max(_REPLAY_RTOL.get(d, 3e-2) for d in dtypes)
    got, want = acc(got.detach()), acc(want.detach())
    tol = rtol * float(want.abs().max()) + 1e-30
    return float((got - want).abs().max()) <= tol


# The check above only reads: it decides whether a module's replay is used or refused, never a number. It runs the
# first time a module is replayed in one way and, once passed on a batch that could have failed it, not again in
# this process while nothing that could change the replay's outcome changed (replay_key). Kept per module object,
# weakly: a module that is freed takes its entries with it (no leak, and a new module at a reused address is
# checked afresh). docs/grad_norms.md, "Never a silently wrong number", states the rule.
_PASSED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()
_MAX_KEYS = 32  # per module: a key that changes every call (an int argument) is then checked every time


def replay_key(rec: Record, call: Call, how: str, batched: list) -> tuple:
    """What a passed check of a replay of `rec.module` in way `how` holds for; the module object itself is the
    cache's (weak) key. Each part is something that can turn a replay that reproduces the output into one that does
    not, without the module object changing:
    - `how`: the kind of replay ("vmap per sequence" padded, "vmap per token" packed, "whole call, padded/packed"):
      each is another computation with its own way to fail (a module can act per sequence but not per token);
    - the `training` flag of the module and of every module below it: dropout and other train-only randomness,
      also in a child the module calls (model.train() after a check in eval mode is checked again);
    - the module's class (FSDP2's fully_shard swaps it) and its replayed parameters by name and dtype (adopted ones
      included, FSDP2's unsharded copies in their dtype): model.to(dtype), a change of what is trainable;
    - the call's arguments: their tree (positional, keywords), each tensor's dtype, rank, device type and whether
      it is replayed per sequence (`batched`: laid out by sequence or token), and the value of every other leaf
      of a plain type (flags that choose a code path; any other object by its type, so the key holds no object
      of the model's alive);
    - its outputs' dtypes and ranks and which of them received a gradient: only those are replayed and checked.
    Not in it: shapes and values, which change every step; the values are the module's business, see
    docs/grad_norms.md for what a user gives up."""
    m = rec.module
    leaves, spec = tree_flatten((call.args, call.kwargs))
    args = tuple((t.dtype, t.dim(), t.device.type, j in batched) if isinstance(t, Tensor) else
                 (type(t).__name__, t if isinstance(t, (int, float, bool, str, type(None))) else
                  str(t) if isinstance(t, (torch.dtype, torch.device)) else None) for j, t in enumerate(leaves))
    params = tuple((n, call.weights.get(n, p).dtype) for n, p in call_params(rec, call).items())
    outs = tuple((v.dtype, v.dim(), g is not None) for v, g in zip(call.values, call.grads))
    return (how, type(m), tuple(x.training for x in m.modules()), params, spec, args, outs)


def replay_checked(module: nn.Module, key: tuple) -> bool:
    """Whether a replay of `module` with this key passed its check before, in this process."""
    keys = _PASSED.get(module)
    return keys is not None and key in keys


def replay_passed(module: nn.Module, key: tuple) -> None:
    """Remember that a replay of `module` with this key reproduced its output on a batch that could have failed."""
    keys = _PASSED.setdefault(module, set())
    if len(keys) < _MAX_KEYS:
        keys.add(key)


def forget_replay_checks() -> None:
    """Check every replay again from the next one on, as on a process's first step (e.g. after changing a module in
    a way replay_key does not see; calling it before every step gives back the check of every replay)."""
    _PASSED.clear()


def tells_sequences_apart(parts: list) -> bool:
    """Whether a check of a replay over `parts` ([(input, dimension it is replayed along)]) could see a module that
    mixes sequences (or tokens): two of them differ in some input. One sequence, or identical ones, reproduce the
    batch's output even when the module averages over them, so such a pass is not remembered. No input replayed
    per sequence: the output cannot depend on another sequence's, only randomness can fail it."""
    if not parts:
        return True
    for t, d in parts:  # the first two sequences usually differ already: the whole input is compared only if not
        if t.shape[d] >= 2 and (not torch.equal(t.narrow(d, 1, 1), t.narrow(d, 0, 1))
                                or bool((t != t.narrow(d, 0, 1)).any())):
            return True
    return False
