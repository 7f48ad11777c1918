"""Running a backend on a test batch and comparing its result with the float64 reference."""

from __future__ import annotations

import torch

import vcpo_kernels as vk
from batches import Batch

COMPILED_BACKENDS = [b for b in vk.available_backends("cpu") if b != "torch"]
FIELDS = ("loss", "ess", "ess_ratio", "lr_scale", "baseline", "advantages", "seq_log_weight", "is_clip_fraction",
          "mean_is_coef", "kl_k3", "num_tokens", "num_seqs", "num_nonfinite", "ppo_clip_fraction")


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
