"""Normalises the two input layouts to one packed form and validates arguments (docs/contract.md, "Inputs"
and "Bad input"). Every backend receives these normalised batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .truncation import check_sampling

LOGP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 inputs stay fp64 (the reference, gradcheck), everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def require_tensor(name: str, value) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _same_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but logp is on {device}: all inputs must share a device")


def _check_any(name: str, bad: Tensor, what: str) -> None:
    """Raise if any element of the boolean tensor `bad` is set (one host read: the `validate` cost)."""
    if bool(bad.any()):
        raise ValueError(f"{name} {what}")


@dataclass
class TokenBatch:
    """Token tensors in packed form: `[N]` each, sequence i is `cu_seqlens[i]:cu_seqlens[i+1]`."""

    logp: Tensor
    behavior_logp: Tensor
    old_logp: Optional[Tensor]
    mask: Optional[Tensor]  # bool, None = every token counts
    cu_seqlens: Tensor  # int64 [B+1]
    padded_length: Optional[int]  # T of the padded layout, None when packed

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def acc_dtype(self) -> torch.dtype:
        return acc_dtype(self.logp.dtype)


def token_batch(
    logp: Tensor,
    behavior_logp: Tensor,
    old_logp: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    validate: bool = True,
) -> TokenBatch:
    logp = require_tensor("logp", logp)
    behavior_logp = require_tensor("behavior_logp", behavior_logp)
    if logp.dtype not in LOGP_DTYPES:
        raise ValueError(f"logp must be float32, bfloat16, float16 or float64, got {logp.dtype}")
    device = logp.device
    ref_tensors = {"behavior_logp": behavior_logp}
    if old_logp is not None:
        ref_tensors["old_logp"] = require_tensor("old_logp", old_logp)
    for name, t in ref_tensors.items():
        _same_device(name, t, device)
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, but logp has {tuple(logp.shape)}")
        if t.dtype not in (logp.dtype, torch.float32):
            raise ValueError(f"{name} must have logp's dtype ({logp.dtype}) or float32, got {t.dtype}")
    if old_logp is not None and old_logp.dtype != behavior_logp.dtype:
        # The kernels read both at one dtype: the wider of the two, so nothing is lost.
        wide = torch.promote_types(behavior_logp.dtype, old_logp.dtype)
        behavior_logp, old_logp = behavior_logp.to(wide), old_logp.to(wide)

    if mask is not None:
        require_tensor("mask", mask)
        _same_device("mask", mask, device)
        if mask.shape != logp.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, but logp has {tuple(logp.shape)}")
        if mask.dtype != torch.bool:
            mask = mask != 0

    if logp.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is for the packed layout: logp must then be 1-D, got 2-D [B, T]")
        num_seqs, length = logp.shape
        cu = torch.arange(num_seqs + 1, device=device, dtype=torch.int64) * length
        padded_length = int(length)
    elif logp.dim() == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens [B+1] is required with packed 1-D logp (or pass padded [B, T] logp)")
        cu = require_tensor("cu_seqlens", cu_seqlens)
        _same_device("cu_seqlens", cu, device)
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of B+1 offsets, got {cu.dtype} {tuple(cu.shape)}")
        cu = cu.to(torch.int64)
        if validate:
            n = logp.numel()
            bad = (cu[0] != 0) | (cu[-1] != n)
            if cu.numel() > 1:
                bad = bad | (cu[1:] < cu[:-1]).any()
            _check_any("cu_seqlens", bad, f"must start at 0, be non-decreasing and end at N = {n}")
        padded_length = None
    else:
        raise ValueError(f"logp must be padded [B, T] or packed [N], got shape {tuple(logp.shape)}")

    def flat(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else t.reshape(-1).contiguous()

    return TokenBatch(flat(logp), flat(behavior_logp), flat(old_logp), flat(mask), cu.contiguous(), padded_length)


@dataclass
class SequenceBatch:
    """Per-sequence inputs, `[B]` each, in the accumulation dtype."""

    rewards: Optional[Tensor]
    advantages: Optional[Tensor]
    group_index: Optional[Tensor]  # int64, None = one group
    num_groups: int
    grad_sq_norm: Optional[Tensor]


def per_sequence(name: str, t, num_seqs: int, device: torch.device, dtype: torch.dtype, validate: bool) -> Tensor:
    """A [B] float input (rewards, advantages, grad_sq_norm) cast to `dtype`; non-finite values are refused."""
    t = require_tensor(name, t)
    _same_device(name, t, device)
    if t.shape != (num_seqs,):
        raise ValueError(f"{name} must have shape [B] = [{num_seqs}], got {tuple(t.shape)}")
    if t.is_complex():
        raise ValueError(f"{name} must be real, got {t.dtype}")
    t = t.detach().to(dtype).contiguous()
    if validate:
        _check_any(name, ~torch.isfinite(t), "must be finite (found NaN or inf)")
    return t


def group_index_tensor(
    group_index, num_groups: Optional[int], num_seqs: int, device: torch.device, validate: bool
) -> tuple[Optional[Tensor], int]:
    if group_index is None:
        if num_groups not in (None, 1):
            raise ValueError(f"num_groups={num_groups} needs a group_index")
        return None, 1
    g = require_tensor("group_index", group_index)
    _same_device("group_index", g, device)
    if g.shape != (num_seqs,):
        raise ValueError(f"group_index must have shape [B] = [{num_seqs}], got {tuple(g.shape)}")
    if g.dtype.is_floating_point or g.is_complex() or g.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got {g.dtype}")
    g = g.to(torch.int64).contiguous()
    if num_groups is None:
        # Reading the largest index is a host sync on a GPU: pass num_groups to avoid it.
        num_groups = int(g.max()) + 1 if num_seqs > 0 else 1
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
    if validate and num_seqs > 0:
        _check_any("group_index", (g < 0) | (g >= num_groups), f"must lie in [0, num_groups) = [0, {num_groups})")
    return g, num_groups


def grad_sq_norm_tensor(grad_sq_norm, num_seqs: int, device: torch.device, dtype: torch.dtype, validate: bool):
    if grad_sq_norm is None:
        return None
    g = per_sequence("grad_sq_norm", grad_sq_norm, num_seqs, device, dtype, validate)
    if validate:
        _check_any("grad_sq_norm", g < 0, "must be >= 0 (it is a squared norm)")
    return g


def sequence_batch(
    tokens: TokenBatch,
    rewards=None,
    advantages=None,
    group_index=None,
    num_groups: Optional[int] = None,
    grad_sq_norm=None,
    batch_scope: bool = False,
    validate: bool = True,
) -> SequenceBatch:
    b, device, dtype = tokens.num_seqs, tokens.logp.device, tokens.acc_dtype
    if (rewards is None) == (advantages is None):
        raise ValueError("pass exactly one of rewards (the loss computes advantages) and advantages")
    r = None if rewards is None else per_sequence("rewards", rewards, b, device, dtype, validate)
    a = None if advantages is None else per_sequence("advantages", advantages, b, device, dtype, validate)
    # A batch-scope baseline ignores the groups: do not even read them (that could be a host sync).
    g, ng = (None, 1) if batch_scope else group_index_tensor(group_index, num_groups, b, device, validate)
    return SequenceBatch(r, a, g, ng, grad_sq_norm_tensor(grad_sq_norm, b, device, dtype, validate))


def _finite_positive(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf")


def linear_logprobs_inputs(
    hidden,
    weight,
    targets,
    bias: Optional[Tensor],
    temperature,
    softcap,
    top_k,
    top_p,
    ignore_index: int,
    chunk_size,
    cu_seqlens,
    seq_grad_sq_norm: Optional[Tensor],
    seq_grad_row_ids: Optional[Tensor],
    seq_grad_rows: Optional[Tensor],
    validate: bool,
) -> int:
    """Checks the arguments of ops.linear_logprobs; returns the chunk size, by default 64 MiB of fp32 logits."""
    hidden = require_tensor("hidden", hidden)
    weight = require_tensor("weight", weight)
    targets = require_tensor("targets", targets)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    n, v = hidden.shape[0], weight.shape[0]
    if targets.shape != (n,) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be an int tensor of shape [N] = [{n}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"bias must have shape [V] = [{v}], got {tuple(bias.shape)}")
    if not _finite_positive(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if softcap is not None and not _finite_positive(softcap):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    check_sampling(top_k, top_p)
    if chunk_size is None:
        chunk_size = max(1, (16 << 20) // max(v, 1))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    per_seq = _per_sequence_grads(hidden, cu_seqlens, seq_grad_sq_norm, seq_grad_row_ids, seq_grad_rows)
    if validate:
        _check_any("targets", (targets != ignore_index) & ((targets < 0) | (targets >= v)),
                   f"must be in [0, V) = [0, {v}) or ignore_index ({ignore_index})")
        if seq_grad_rows is not None:
            _check_any("seq_grad_row_ids", (seq_grad_row_ids < 0) | (seq_grad_row_ids >= v),
                       f"must be in [0, V) = [0, {v})")
        if per_seq:
            cu = cu_seqlens.tolist()
            if cu[0] != 0 or cu[-1] != n or any(a > b for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to N = {n}, got {cu}")
    return chunk_size


def _per_sequence_grads(hidden: Tensor, cu_seqlens, seq_grad_sq_norm, seq_grad_row_ids, seq_grad_rows) -> bool:
    """Checks linear_logprobs' per-sequence gradient outputs and their cu_seqlens; whether any is asked for."""
    per_seq = seq_grad_sq_norm is not None or seq_grad_rows is not None
    if (seq_grad_rows is None) != (seq_grad_row_ids is None):
        raise ValueError("seq_grad_rows and seq_grad_row_ids go together")
    if not per_seq:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only used with seq_grad_sq_norm or seq_grad_rows")
        return False
    if cu_seqlens is None:
        raise ValueError("seq_grad_sq_norm and seq_grad_rows need cu_seqlens (the sequence boundaries)")
    cu_seqlens = require_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int tensor [B+1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    b = cu_seqlens.numel() - 1
    if seq_grad_sq_norm is not None and (seq_grad_sq_norm.shape != (b,) or not seq_grad_sq_norm.is_floating_point()):
        raise ValueError(f"seq_grad_sq_norm must be a float tensor of shape [B] = [{b}]")
    if seq_grad_rows is not None:
        ids = require_tensor("seq_grad_row_ids", seq_grad_row_ids)
        if ids.dim() != 2 or ids.shape[0] != b or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seq_grad_row_ids must be an int tensor [B, K] with B = {b}, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        want = (b, ids.shape[1], hidden.shape[1])
        if seq_grad_rows.shape != want or not seq_grad_rows.is_floating_point():
            raise ValueError(f"seq_grad_rows must be a float tensor of shape [B, K, H] = {list(want)}, got "
                             f"{seq_grad_rows.dtype} {tuple(seq_grad_rows.shape)}")
    return True
