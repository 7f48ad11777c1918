"""Running a backend on a test batch and comparing its result with the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch

import vcpo_kernels as vk
from support.batches import Batch

COMPILED_BACKENDS = [b for b in vk.available_backends("cpu") if b != "torch"]
FIELDS = ("loss", "ess", "ess_ratio", "lr_scale", "baseline", "advantages", "seq_log_weight", "is_clip_fraction",
          "mean_is_coef", "kl_k3", "num_tokens", "num_seqs", "num_nonfinite", "ppo_clip_fraction",
          "rejected_fraction")


def poison_heap(*numels: int) -> None:
    """Leave NaN-filled blocks of these sizes on the allocator's free lists, so that an output element a
    kernel forgets to write shows up as NaN instead of a lucky zero."""
    for n in numels:
        torch.full((max(n, 1),), float("nan"))


def run(batch: Batch, backend: str, *, advantages=None, **options):
    """(result, d loss / d logp) of one forward and backward."""
    logp = batch.logp.detach().clone().requires_grad_()
    kw = batch.kwargs()
    if advantages is not None:
        kw.pop("rewards")
        kw["advantages"] = advantages
    n = logp.numel()
    poison_heap(n, batch.num_groups, batch.rewards.numel(), 16)
    out = vk.policy_loss(logp, batch.behavior_logp, backend=backend, **kw, **options)
    out.loss.backward()
    return out, logp.grad


def assert_matches(got, got_grad, want, want_grad, *, rtol: float, atol: float) -> None:
    for name in FIELDS:
        a, b = getattr(got, name).double(), getattr(want, name).double()
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(got_grad.double(), want_grad.double(), rtol=rtol, atol=atol)


class _RecordVcpoOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Keeps the arguments of the first call of each vcpo:: op that runs under it."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "vcpo":
            self.calls.setdefault(func, args)
        return func(*args, **(kwargs or {}))


def vcpo_op_calls(backend: str, device: str) -> dict:
    """{op: positional arguments} of one real call of every vcpo:: op, made through the public API on device."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(10, generator=g)
    cu = torch.tensor([0, 3, 3, 7, 10])
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    with _RecordVcpoOps() as rec:
        lp, mu, old, cu, rewards, groups = to(logp, logp - 0.1, logp + 0.05, cu, torch.rand(4, generator=g),
                                              torch.tensor([0, 0, 1, 1]))
        lp.requires_grad_()
        out = vk.policy_loss(lp, mu, old_logp=old, mask=torch.rand(10, generator=g).to(device) > 0.2, cu_seqlens=cu,
                             rewards=rewards, group_index=groups, grad_sq_norm=rewards + 1, backend=backend)
        out.loss.backward()
        vk.sequence_stats(lp.detach(), mu, cu_seqlens=cu, backend=backend)
        vk.effective_sample_size(out.seq_log_weight, seq_length=rewards + 1, backend=backend)
        vk.opob_baseline(rewards, out.seq_log_weight, group_index=groups, num_groups=2, backend=backend)
        h, w = to(torch.randn(6, 8, generator=g), torch.randn(12, 8, generator=g))
        h.requires_grad_()
        res = vk.linear_logprobs(h, w, torch.tensor([1, 2, 3, -100, 5, 6]).to(device), return_entropy=True,
                                 return_sum_p2=True, backend=backend)
        (res.logp.sum() + res.entropy.sum() + res.sum_p2.sum()).backward()
    return rec.calls


def assert_refuses_other_devices(calls: dict, kernel_device: str, other_device: str) -> int:
    """Each op's kernel for kernel_device, called with one tensor argument at a time moved to other_device,
    raises an error naming that argument; returns the number of cases checked."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA if kernel_device == "cuda" else torch._C.DispatchKey.CPU)
    checked = 0
    for op, args in calls.items():
        for j, arg in enumerate(op._schema.arguments):
            # grad_loss is a scalar read where it lies (moved to the op's device first): any device is accepted
            if not isinstance(args[j], torch.Tensor) or arg.name == "grad_loss":
                continue
            moved = list(args)
            moved[j] = args[j].detach().to(other_device)
            with pytest.raises(RuntimeError, match=rf"\b{arg.name}\b is on {other_device}"):
                op.redispatch(keys, *moved)
            checked += 1
    return checked


def packed_lm_inputs(lengths: torch.Tensor, vocab: int):
    """(cu_seqlens, input ids [1, N], position ids restarting per sequence, a float64 block-diagonal causal
    4-D attention mask, which tokens are predicted) for sequences of `lengths` packed into one row."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    ids = torch.randint(1, vocab, (1, n))
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.cat([torch.arange(int(k)) for k in lengths]).unsqueeze(0)
    allowed = (seg[:, None] == seg[None, :]) & (torch.arange(n)[:, None] >= torch.arange(n)[None, :])
    mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)[None, None]
    # token t is predicted from position t - 1 of the same sequence: the first token of each sequence has none
    predicted = torch.ones(n, dtype=torch.bool)
    predicted[cu[:-1]] = False
    return cu, ids, pos, mask, predicted
