"""The GPU backends ("cuda" and "triton" on CUDA tensors) against the float64 reference on the CPU: every
option set, both layouts, fp32/fp64/bf16, long sequences, linear_logprobs, and no host sync in a loss call.
Skipped without a GPU (bench/gpu_check.sh runs them on one)."""

import zlib

import pytest
import torch

import vcpo_kernels as vk
from batches import Batch, random_batch
from cases import OPTION_CASES, WITH_OLD
from helpers import assert_matches, run

GPU = torch.cuda.is_available()
GPU_BACKENDS = [b for b in vk.available_backends("cuda") if b != "torch"] if GPU else []
pytestmark = [pytest.mark.skipif(not GPU, reason="no CUDA device"),
              pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])]
CASES = [(name, old) for name in OPTION_CASES for old in ([False, True] if name in WITH_OLD else [False])]


def _cuda(batch: Batch) -> Batch:
    move = lambda t: None if t is None else t.cuda()  # noqa: E731
    return Batch(move(batch.logp), move(batch.behavior_logp), move(batch.old_logp), move(batch.mask),
                 move(batch.cu_seqlens), move(batch.rewards), move(batch.group_index), batch.num_groups,
                 move(batch.grad_sq_norm), dict(batch.extra))


def _cpu(out):
    return type(out)(**{k: v.cpu() for k, v in vars(out).items()})


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,with_old", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_reference_on_gpu(backend, name, with_old, layout, dtype):
    seed = zlib.crc32(f"gpu{name}{with_old}{layout}{dtype}".encode())
    batch = random_batch(seed, layout, dtype=torch.float32 if dtype == torch.bfloat16 else dtype, with_old=with_old)
    if dtype == torch.bfloat16:
        batch = batch.to(torch.bfloat16)
    want, want_grad = run(batch.to(torch.float64), "torch", **OPTION_CASES[name])
    got, got_grad = run(_cuda(batch), backend, **OPTION_CASES[name])
    tol = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6),
           torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[dtype]
    assert got_grad.dtype == dtype
    assert_matches(_cpu(got), got_grad.cpu(), want, want_grad, **tol)


@pytest.mark.parametrize("lengths", [[131072, 3, 70000], [1] * 300])
def test_long_and_many_sequences_on_gpu(backend, lengths):
    g = torch.Generator().manual_seed(len(lengths))
    n = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    logp = -torch.rand(n, generator=g, dtype=torch.float64)
    mu = logp + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    old = logp + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    b = len(lengths)
    kw = dict(old_logp=old, rewards=torch.rand(b, generator=g, dtype=torch.float64),
              group_index=torch.arange(b) % 2, num_groups=2, is_level="token", clip_ratio=(0.2, 0.2))
    results = []
    for backend_, device in (("torch", "cpu"), (backend, "cuda")):
        lp = logp.to(device).requires_grad_()
        args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = vk.policy_loss(lp, mu.to(device), cu_seqlens=cu.to(device), backend=backend_, **args)
        out.loss.backward()
        results.append((_cpu(out), lp.grad.cpu()))
    assert_matches(*results[1], *results[0], rtol=1e-10, atol=1e-12)


def test_no_host_sync_in_a_loss_call(backend):
    batch = _cuda(random_batch(3, "packed", with_old=True))
    logp = batch.logp.detach().clone().requires_grad_()
    kw = batch.kwargs()
    vk.policy_loss(logp, batch.behavior_logp, backend=backend, validate=False, **kw).loss.backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = vk.policy_loss(logp, batch.behavior_logp, backend=backend, validate=False, **kw)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_linear_logprobs_on_gpu(backend):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(300, 64, generator=g, dtype=torch.float64)
    weight = torch.randn(5000, 64, generator=g, dtype=torch.float64) / 8
    targets = torch.randint(0, 5000, (300,), generator=g)
    targets[3] = -100
    results = []
    for backend_, device in (("torch", "cpu"), (backend, "cuda")):
        h = hidden.to(device).requires_grad_()
        w = weight.to(device).requires_grad_()
        out = vk.linear_logprobs(h, w, targets.to(device), return_entropy=True, return_sum_p2=True, chunk_size=128,
                                 backend=backend_)
        (out.logp.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
        results.append([t.detach().cpu() for t in (out.logp, out.entropy, out.sum_p2, h.grad, w.grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
