"""The GPU backends ("cuda" and "triton" on CUDA tensors) against the float64 reference on the CPU: every
option set, both layouts, fp32/fp64/bf16, long sequences, linear_logprobs, and no host sync in a loss call.
The GPU tests skip without a GPU (bench/gpu_check.sh runs them on one); the comparisons of long sequences and
of linear_logprobs also run here with the CPU backends in float32 as the second run (the same bodies, a dtype
change in place of the device move), so their plumbing is exercised on every machine."""

import zlib

import pytest
import torch

import vcpo_kernels as vk
from support.batches import Batch, random_batch
from support.cases import OPTION_CASES, GPU_EXTRA_CASES, case_runs
from support.backend_check import assert_matches, assert_refuses_other_devices, run, vcpo_op_calls

GPU = torch.cuda.is_available()
GPU_BACKENDS = [b for b in vk.available_backends("cuda") if b != "torch"] if GPU else []
cpu_rehearsal = pytest.mark.parametrize("backend", [b for b in vk.available_backends("cpu") if b != "torch"])
CASES = [(name, old) for name in OPTION_CASES for old in case_runs(name)]
# Tolerances against the float64 reference by the dtype of the run under test.
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def on_gpu(test):
    """Run for every GPU backend; skipped without a GPU."""
    test = pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])(test)
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="no CUDA device")(test))


def _cuda(batch: Batch) -> Batch:
    move = lambda t: None if t is None else t.cuda()  # noqa: E731
    return Batch(move(batch.logp), move(batch.behavior_logp), move(batch.old_logp), move(batch.mask),
                 move(batch.cu_seqlens), move(batch.rewards), move(batch.group_index), batch.num_groups,
                 move(batch.grad_sq_norm), dict(batch.extra))


def _cpu(out):
    return type(out)(**{k: v.cpu() for k, v in vars(out).items()})


def _leaf(x: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf on device in dtype: .to() alone would return x itself when nothing changes (which would
    then require grad), or a non-leaf whose .grad stays None."""
    return x.detach().to(device, dtype).requires_grad_()


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,with_old", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@on_gpu
def test_matches_reference_on_gpu(backend, name, with_old, layout, dtype):
    seed = zlib.crc32(f"gpu{name}{with_old}{layout}{dtype}".encode())
    batch = random_batch(seed, layout, dtype=torch.float32 if dtype == torch.bfloat16 else dtype, with_old=with_old)
    if dtype == torch.bfloat16:
        batch = batch.to(torch.bfloat16)
    want, want_grad = run(batch.to(torch.float64), "torch", **OPTION_CASES[name])
    got, got_grad = run(_cuda(batch), backend, **OPTION_CASES[name])
    assert got_grad.dtype == dtype
    assert_matches(_cpu(got), got_grad.cpu(), want, want_grad, **TOL[dtype])


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(GPU_EXTRA_CASES))
@pytest.mark.parametrize("with_old", [False, True])
@on_gpu
def test_rejection_and_robust_baselines_on_gpu(backend, name, with_old, layout):
    """Every rejection family (token, sequence, M2PO's batch mask) and OPOB's median and winsorized mean on the GPU
    against the float64 reference."""
    batch = random_batch(zlib.crc32(f"gpu-reject{name}{with_old}{layout}".encode()), layout, with_old=with_old,
                         spread=0.4, num_seqs=11)
    want, want_grad = run(batch.to(torch.float64), "torch", **GPU_EXTRA_CASES[name])
    got, got_grad = run(_cuda(batch), backend, **GPU_EXTRA_CASES[name])
    assert_matches(_cpu(got), got_grad.cpu(), want, want_grad, **TOL[torch.float32])


@pytest.mark.parametrize("scope", ["group", "batch"])
@on_gpu
def test_opob_leave_one_out_on_gpu(backend, scope):
    """Leave-one-out OPOB with one w^2 1e30 times the others' in each group (the float64 brute force of
    test_opob_leave_one_out.py holds the reference to it), and opob_max_share, against the reference."""
    g = torch.Generator().manual_seed(47)
    s = 0.3 * torch.randn(16, 1, generator=g, dtype=torch.float64)
    s[[2, 11]] += 35.0
    kw = dict(rewards=torch.rand(16, generator=g, dtype=torch.float64), group_index=torch.arange(16) // 8,
              grad_sq_norm=torch.rand(16, generator=g, dtype=torch.float64), opob_leave_one_out=True,
              opob_scope=scope)
    want = vk.policy_loss(s, torch.zeros_like(s), backend="torch", **kw)
    got = vk.policy_loss(s.cuda(), torch.zeros_like(s).cuda(), backend=backend,
                         **{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    for name in ("advantages", "baseline", "opob_max_share"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=1e-12, atol=1e-12)


def long_and_many_sequences(backend: str, device: str, dtype: torch.dtype, lengths: list) -> None:
    """policy_loss of `backend` on `device` in `dtype` against the float64 reference on the CPU."""
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
    for backend_, device_, dtype_ in (("torch", "cpu", torch.float64), (backend, device, dtype)):
        lp = _leaf(logp, device_, dtype_)
        cast = lambda v: v.to(device_, dtype_ if v.is_floating_point() else v.dtype)  # noqa: E731
        args = {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = vk.policy_loss(lp, cast(mu), cu_seqlens=cu.to(device_), backend=backend_, **args)
        out.loss.backward()
        assert lp.grad is not None and lp.grad.dtype == dtype_
        results.append((_cpu(out), lp.grad.cpu()))
    assert_matches(*results[1], *results[0], **TOL[dtype])


def linear_logprobs_matches(backend: str, device: str, dtype: torch.dtype, **options) -> None:
    """linear_logprobs (values and both gradients) of `backend` on `device` in `dtype` against float64 on the CPU,
    with `options` (temperature, softcap) passed to both."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(300, 64, generator=g, dtype=torch.float64)
    weight = torch.randn(5000, 64, generator=g, dtype=torch.float64) / 8
    targets = torch.randint(0, 5000, (300,), generator=g)
    targets[::2] = (hidden @ weight.T).argmax(1)[::2]  # inside any top-k / top-p support (random ones mostly not)
    targets[3] = -100
    results = []
    for backend_, device_, dtype_ in (("torch", "cpu", torch.float64), (backend, device, dtype)):
        h, w = _leaf(hidden, device_, dtype_), _leaf(weight, device_, dtype_)
        out = vk.linear_logprobs(h, w, targets.to(device_), return_entropy=True, return_sum_p2=True, chunk_size=128,
                                 backend=backend_, **options)
        (out.logp.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
        assert h.grad is not None and w.grad is not None
        results.append([t.detach().cpu().double() for t in (out.logp, out.entropy, out.sum_p2, h.grad, w.grad)])
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for name, a, b in zip(("logp", "entropy", "sum_p2", "d hidden", "d weight"), *results):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


LENGTHS = [[131072, 3, 70000], [1] * 300]


@pytest.mark.parametrize("lengths", LENGTHS)
@on_gpu
def test_long_and_many_sequences_on_gpu(backend, lengths):
    long_and_many_sequences(backend, "cuda", torch.float64, lengths)


@pytest.mark.slow  # 20 s under the Triton interpreter
@pytest.mark.parametrize("lengths", LENGTHS)
@cpu_rehearsal
def test_long_and_many_sequences_rehearsal_on_cpu(backend, lengths):
    long_and_many_sequences(backend, "cpu", torch.float32, lengths)


@on_gpu
def test_linear_logprobs_on_gpu(backend):
    linear_logprobs_matches(backend, "cuda", torch.float64)


@cpu_rehearsal
def test_linear_logprobs_rehearsal_on_cpu(backend):
    linear_logprobs_matches(backend, "cpu", torch.float32)


# A softcap of the logits' size with a temperature: in fp64 on the GPU the cap and the temperature must reach
# the kernels unrounded (Triton passes float arguments as fp32).
SOFTCAPPED = dict(softcap=1.5, temperature=0.7)


@on_gpu
def test_softcapped_linear_logprobs_on_gpu(backend):
    linear_logprobs_matches(backend, "cuda", torch.float64, **SOFTCAPPED)


@cpu_rehearsal
def test_softcapped_linear_logprobs_rehearsal_on_cpu(backend):
    if backend == "triton":  # ~20 s in the interpreter, for plumbing its unsoftcapped rehearsal already runs
        pytest.skip("the Triton passes with a softcap are tested in test_linear_logprobs.py")
    linear_logprobs_matches(backend, "cpu", torch.float32, **SOFTCAPPED)


# top-k and top-p: the support is decided on the device (a sort per chunk), a target outside it is -inf
TRUNCATED = dict(top_k=200, top_p=0.9, temperature=0.8)


@on_gpu
def test_truncated_linear_logprobs_on_gpu(backend):
    linear_logprobs_matches(backend, "cuda", torch.float64, **TRUNCATED)


@on_gpu
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


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no CUDA device")
def test_cuda_kernels_refuse_a_tensor_on_another_device():
    calls = vcpo_op_calls("cuda", "cuda")
    assert len(calls) == 7
    assert assert_refuses_other_devices(calls, "cuda", "cpu") >= 30
