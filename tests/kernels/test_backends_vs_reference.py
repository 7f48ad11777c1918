"""Every compiled backend against the float64 reference, on fresh random inputs, every option set, both
layouts and every input dtype."""

import zlib

import pytest
import torch

import vcpo_kernels as vk
from support.batches import random_batch
from support.cases import OPTION_CASES, case_runs
from support.backend_check import COMPILED_BACKENDS, assert_matches, run

CASES = [(name, old) for name in OPTION_CASES for old in case_runs(name)]
IDS = [f"{n}{'-old' if o else ''}" for n, o in CASES]
pytestmark = pytest.mark.parametrize("backend", COMPILED_BACKENDS)


def test_cpu_backend_is_built(backend):
    assert "cpu" in vk.available_backends("cpu"), "the C++ extension did not load"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,with_old", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(backend, name, with_old, layout, dtype):
    seed = zlib.crc32(f"{name}{with_old}{layout}{dtype}".encode())  # distinct inputs per case, reproducible
    batch = random_batch(seed, layout, dtype=dtype, with_old=with_old)
    want, want_grad = run(batch.to(torch.float64), "torch", **OPTION_CASES[name])
    got, got_grad = run(batch, backend, **OPTION_CASES[name])
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    assert_matches(got, got_grad, want, want_grad, **tol)
    assert got.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got_grad.dtype == dtype


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_given_advantages(backend, layout):
    batch = random_batch(11, layout)
    adv = torch.randn(batch.rewards.shape)
    want, want_grad = run(batch.to(torch.float64), "torch", advantages=adv)
    got, got_grad = run(batch, backend, advantages=adv)
    assert_matches(got, got_grad, want, want_grad, rtol=2e-5, atol=2e-6)


def test_packed_without_mask(backend):
    batch = random_batch(5, "packed", packed_mask=False, with_old=True)
    assert batch.mask is None
    want, want_grad = run(batch.to(torch.float64), "torch", clip_ratio=(0.2, 0.2))
    got, got_grad = run(batch, backend, clip_ratio=(0.2, 0.2))
    assert_matches(got, got_grad, want, want_grad, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ref_dtype", ["same", "float32"])
@pytest.mark.parametrize("case", ["default", "token-truncate", "ppo-clip"])
def test_half_precision_inputs(backend, low, ref_dtype, case):
    """bf16/fp16 logp (behavior/old at the same dtype or fp32): fp32 accumulation, gradient in logp's dtype.
    The reference sees the same rounded values in float64, so only accumulation and output rounding differ."""
    batch = random_batch(7, "padded", with_old=case == "ppo-clip").to(low, logp_only=ref_dtype == "float32")
    want, want_grad = run(batch.to(torch.float64), "torch", **OPTION_CASES[case])
    got, got_grad = run(batch, backend, **OPTION_CASES[case])
    assert got_grad.dtype == low and got.loss.dtype == torch.float32
    assert_matches(got, got_grad.float(), want, want_grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_standalone_ops_match_reference(backend, layout):
    batch = random_batch(21, layout, with_old=True)
    kw = dict(mask=batch.mask, cu_seqlens=batch.cu_seqlens, old_logp=batch.old_logp)
    b64 = batch.to(torch.float64)
    want = vk.sequence_stats(b64.logp, b64.behavior_logp, backend="torch", **{**kw, "old_logp": b64.old_logp})
    got = vk.sequence_stats(batch.logp, batch.behavior_logp, backend=backend, **kw)
    for name in ("seq_log_weight", "seq_length", "seq_kl_k3"):
        torch.testing.assert_close(getattr(got, name).double(), getattr(want, name), rtol=2e-5, atol=2e-6)

    s, length = want.seq_log_weight, want.seq_length
    for rule, base in (("sqrt", 1.0), ("linear", 0.55), (None, 1.0)):
        e_want = vk.effective_sample_size(s, seq_length=length, lr_rule=rule, ess_base_ratio=base, backend="torch")
        e_got = vk.effective_sample_size(s, seq_length=length, lr_rule=rule, ess_base_ratio=base, backend=backend)
        for name in ("ess", "ess_ratio", "lr_scale"):
            torch.testing.assert_close(getattr(e_got, name), getattr(e_want, name), rtol=1e-12, atol=0)

    for length_norm in (False, True):
        for norm_by_std in (False, True):
            args = dict(grad_sq_norm=batch.grad_sq_norm, group_index=batch.group_index,
                        num_groups=batch.num_groups, seq_length=length, length_norm=length_norm,
                        norm_by_std=norm_by_std)
            o_want = vk.opob_baseline(batch.rewards, s, backend="torch", **args)
            o_got = vk.opob_baseline(batch.rewards, s, backend=backend, **args)
            torch.testing.assert_close(o_got.baseline, o_want.baseline, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o_got.advantages, o_want.advantages, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_seqs,max_len", [(64, 700), (3, 40_000)])
def test_large_batches_use_threads(backend, num_seqs, max_len):
    """Shapes large enough to be split across threads (many sequences; a few very long ones)."""
    batch = random_batch(3, "packed", num_seqs=num_seqs, max_len=max_len, with_old=True, groups=8)
    want, want_grad = run(batch.to(torch.float64), "torch", is_level="token", clip_ratio=(0.2, 0.2))
    got, got_grad = run(batch, backend, is_level="token", clip_ratio=(0.2, 0.2))
    assert_matches(got, got_grad, want, want_grad, rtol=1e-4, atol=1e-6)


def test_prompt_response_padding_rows(backend):
    """The usual padded RL row, [prompt | response | padding], with spans of every length around the 8-byte
    steps in which the kernel skips uncounted tokens, and a few uncounted tokens (tool output) inside."""
    batch = random_batch(12, "padded", num_seqs=40, max_len=64, with_old=True)
    g = torch.Generator().manual_seed(12)
    pos = torch.arange(64)
    prompt = torch.arange(40) % 23  # 0..22
    response = (torch.arange(40) * 7) % 41  # 0..40, so some rows are empty
    mask = (pos >= prompt[:, None]) & (pos < (prompt + response)[:, None])
    mask &= torch.rand(40, 64, generator=g) < 0.95
    batch.mask = mask
    for name in ("logp", "behavior_logp", "old_logp"):
        setattr(batch, name, torch.where(mask, getattr(batch, name).nan_to_num(-1.0), torch.nan))
    for opts in ({}, dict(is_level="token", clip_ratio=(0.2, 0.2))):
        want, want_grad = run(batch.to(torch.float64), "torch", **opts)
        got, got_grad = run(batch, backend, **opts)
        assert_matches(got, got_grad, want, want_grad, rtol=2e-5, atol=2e-6)


def test_deterministic_across_thread_counts(backend):
    """Each sequence is reduced by one thread in a fixed order and the per-sequence results are combined
    serially, so the result is bitwise the same for any number of threads."""
    batch = random_batch(13, "packed", num_seqs=64, max_len=900, with_old=True, groups=8)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run(batch, backend, is_level="token", clip_ratio=(0.2, 0.2)))
    finally:
        torch.set_num_threads(threads)
    for out, grad in results[1:]:
        assert_matches(out, grad, *results[0], rtol=0, atol=0)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_half_precision_packed(backend, low):
    batch = random_batch(18, "packed", with_old=True).to(low)
    want, want_grad = run(batch.to(torch.float64), "torch", is_level="token")
    got, got_grad = run(batch, backend, is_level="token")
    assert_matches(got, got_grad.float(), want, want_grad, rtol=1e-2, atol=1e-4)
