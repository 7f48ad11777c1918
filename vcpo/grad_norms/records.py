"""What the recorder keeps of a module's forward and backward (its calls), and what every rule shares: the refusal,
the accumulation dtype, chunking of per-sequence temporaries, the check of a replay against the recorded output."""

from __future__ import annotations

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
