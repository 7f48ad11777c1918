"""Edge cases of the contract on every backend: empty batches, all-masked and one-token sequences,
one-member groups, extreme and non-finite log ratios."""

import math
import os
import subprocess
import sys

import pytest
import torch

import vcpo_kernels as vk
from support.batches import random_batch
from support.backend_check import COMPILED_BACKENDS, assert_matches, run
from support.cases import OPTION_CASES

ALL_BACKENDS = ["torch"] + COMPILED_BACKENDS


def _loss(backend, logp, mu, **kw):
    logp = logp.detach().clone().requires_grad_()
    out = vk.policy_loss(logp, mu, backend=backend, **kw)
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_empty_batch(backend, layout):
    if layout == "padded":
        logp, kw = torch.zeros(0, 5), {}
    else:
        logp, kw = torch.zeros(0), dict(cu_seqlens=torch.zeros(1, dtype=torch.int64))
    out, grad = _loss(backend, logp, logp.clone(), rewards=torch.zeros(0), **kw)
    assert out.loss.item() == 0 and grad.shape == logp.shape
    assert out.ess.item() == 0 and out.ess_ratio.item() == 0 and out.lr_scale.item() == 0
    assert out.num_seqs.item() == 0 and out.num_tokens.item() == 0
    assert out.advantages.shape == (0,) and out.baseline.shape == (1,)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_sequences_masked(backend):
    logp = torch.full((3, 4), torch.nan)  # nothing counts, so nothing may be read
    out, grad = _loss(backend, logp, logp.clone(), mask=torch.zeros(3, 4, dtype=torch.bool), rewards=torch.ones(3))
    assert out.loss.item() == 0 and torch.all(grad == 0)
    assert out.lr_scale.item() == 0 and out.num_seqs.item() == 0 and out.num_nonfinite.item() == 0
    assert torch.all(out.advantages == 0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("advantage", ["opob", "grpo", "rloo"])
def test_one_member_groups_have_zero_advantage(backend, advantage):
    batch = random_batch(4, "padded")
    b = batch.rewards.numel()
    out, grad = _loss(backend, batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                      group_index=torch.arange(b), advantage=advantage)
    assert torch.all(out.advantages == 0)
    assert torch.all(grad == 0)
    valid = batch.mask.any(1)
    torch.testing.assert_close(out.baseline.double()[valid], batch.rewards[valid], rtol=0, atol=0)


def _extreme_batch(scale, dtype):
    """Sequences whose log weights s_i reach about +-scale: exp(s) overflows any float type."""
    g = torch.Generator().manual_seed(0)
    b, t = 6, 10
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64)
    offsets = torch.tensor([1.0, 0.999, 0.5, -0.2, -1.0, 0.9999], dtype=torch.float64)[:, None] * scale / t
    mu = logp - offsets - 1e-3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return logp.to(dtype), mu.to(dtype)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [100.0, 1e4])
def test_extreme_log_ratios(backend, dtype, scale):
    logp, mu = _extreme_batch(scale, dtype)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    out, grad = _loss(backend, logp, mu, rewards=rewards, group_index=groups, grad_sq_norm=torch.rand(6) + 0.5)
    for name in ("loss", "ess", "ess_ratio", "lr_scale", "baseline", "advantages"):
        assert torch.all(torch.isfinite(getattr(out, name))), name
    assert torch.all(torch.isfinite(grad)) and out.num_nonfinite.item() == 0
    # ESS is shift-invariant: the same weights shifted by -max give ordinary numbers.
    s = out.seq_log_weight.double()
    w = torch.exp(s - s.max())
    want = (w.sum() ** 2 / (w * w).sum()).item()
    assert math.isclose(out.ess.item(), want, rel_tol=1e-3 if dtype == torch.float32 else 1e-9)
    assert 1 / 6 - 1e-6 <= out.ess_ratio.item() <= 1 + 1e-6
    # Baselines stay within each group's reward range.
    assert torch.all((out.baseline >= 0) & (out.baseline <= 1))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", [torch.nan, torch.inf])
def test_nonfinite_weights_skip_the_step(backend, bad):
    """NaN in a counted logp, or mu = -inf (so s = +inf), is reported and never turns into a full lr."""
    batch = random_batch(8, "padded")
    logp, mu = batch.logp.clone(), batch.behavior_logp.clone()
    if bad != bad:
        logp[0, batch.mask[0].nonzero()[0, 0]] = torch.nan
    else:
        mu[0, batch.mask[0].nonzero()[0, 0]] = -torch.inf
    for rule in ("sqrt", "linear", None):
        out = vk.policy_loss(logp, mu, mask=batch.mask, rewards=batch.rewards, group_index=batch.group_index,
                             backend=backend, lr_rule=rule)
        assert out.num_nonfinite.item() == 1
        assert math.isnan(out.ess_ratio.item())
        assert out.lr_scale.item() == 0


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_zero_weight_sequence_is_not_an_error(backend):
    """logp = -inf on a counted token gives s = -inf: a zero weight, reported but not a skipped step."""
    batch = random_batch(9, "packed", with_old=True)
    first = int(batch.cu_seqlens[3])
    batch.mask[first] = True
    batch.old_logp, batch.behavior_logp = batch.old_logp.clone(), batch.behavior_logp.clone()
    batch.old_logp[first], batch.behavior_logp[first] = -torch.inf, -1.0
    want, _ = run(batch.to(torch.float64), "torch")
    got, _ = run(batch, backend)
    assert got.num_nonfinite.item() == 1 and got.lr_scale.item() > 0
    torch.testing.assert_close(got.ess.double(), want.ess, rtol=2e-5, atol=0)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("case", ["token-truncate", "ppo-clip-truncate", "gspo-dual-token-mask", "gmpo-token-mask",
                                  "cispo", "dppo-tv-capped", "sapo"])
def test_masked_values_are_never_read(backend, case):
    """NaN, +-inf or zeros in the tokens that do not count give bitwise the same result, under every trust region."""
    batch = random_batch(10, "padded", with_old=True)
    results = []
    for fill in (0.0, torch.nan, torch.inf, -torch.inf):
        b = batch.to(torch.float32)
        for name in ("logp", "behavior_logp", "old_logp"):
            setattr(b, name, torch.where(batch.mask, getattr(b, name), fill))
        results.append(run(b, backend, **OPTION_CASES[case]))
    for out, grad in results[1:]:
        assert_matches(out, grad, *results[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_unvalidated_bad_offsets_and_groups_fail_safely(backend):
    """validate=False skips the Python value checks; the C++ op still refuses what would read or write out of
    bounds (a RuntimeError, not a crash). The Triton kernels cannot raise without a host sync: they clip every
    index to its tensor instead, so the same calls finish (in a subprocess: an out-of-bounds access under the
    interpreter kills the process)."""
    if backend == "triton":
        script = (
            "import torch, vcpo_kernels as vk\n"
            "logp = -torch.rand(6)\n"
            "vk.policy_loss(logp, logp.clone(), cu_seqlens=torch.tensor([10**12, 10**12 + 3, 10**12 + 6]),"
            " rewards=torch.rand(2), backend='triton', validate=False)\n"
            "vk.policy_loss(logp.reshape(2, 3).requires_grad_(), logp.reshape(2, 3).clone(), rewards=torch.rand(2),"
            " group_index=torch.tensor([0, 10**12]), num_groups=2, backend='triton', validate=False)"
            ".loss.backward()\n"
            "vk.opob_baseline(torch.rand(2), torch.zeros(2), group_index=torch.tensor([0, -1]), num_groups=2,"
            " backend='triton', validate=False)\n"
            "print('finished')\n")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TRITON_INTERPRET": "1"})
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-2000:]
        return
    logp = -torch.rand(6)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        vk.policy_loss(logp, logp.clone(), cu_seqlens=torch.tensor([0, 4000, 6]), rewards=torch.rand(2),
                       backend=backend, validate=False)
    with pytest.raises(RuntimeError, match="group_index"):
        vk.policy_loss(logp.reshape(2, 3), logp.reshape(2, 3).clone(), rewards=torch.rand(2),
                       group_index=torch.tensor([0, 1_000_000]), num_groups=2, backend=backend, validate=False)
    with pytest.raises(RuntimeError, match="group_index"):
        vk.opob_baseline(torch.rand(2), torch.zeros(2), group_index=torch.tensor([0, -1]), num_groups=2,
                         backend=backend, validate=False)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("delta", [-103.0, -90.0, -87.5, 87.9, 88.4, 88.7])
def test_fp32_exp_near_the_float_range_ends(backend, delta):
    """Log ratios near the ends of fp32's exp range: the K3 term of Delta = delta, and the ratio
    r = exp(delta) in the gradient, stay accurate (no clamping error, no spurious overflow)."""
    logp = torch.full((1, 4), -1.0)
    mu = logp.clone()
    mu[0, 1] -= delta  # Delta = delta on token 1 (bypass: lp_prox = logp)
    got, _ = _loss(backend, logp, mu, rewards=torch.ones(1), is_correction="none")
    want, _ = _loss("torch", logp.double(), mu.double(), rewards=torch.ones(1), is_correction="none")
    torch.testing.assert_close(got.kl_k3.double(), want.kl_k3, rtol=1e-5, atol=0)

    old = logp.clone()
    old[0, 2] -= delta  # r = exp(delta) on token 2; behavior = old, so every Delta is 0
    kw = dict(advantages=torch.ones(1), is_correction="none")
    got, got_grad = _loss(backend, logp, old.clone(), old_logp=old, **kw)
    want, want_grad = _loss("torch", logp.double(), old.double(), old_logp=old.double(), **kw)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-44)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bypass_ratio_is_one_even_for_nonfinite_logp(backend):
    """In bypass mode r = 1: a counted logp = -inf (s = -inf, weight 0) removes its sequence and nothing
    else; the loss and gradient stay finite and equal across backends."""
    batch = random_batch(14, "padded")
    logp = batch.logp.clone()
    logp[3, batch.mask[3].nonzero()[0, 0]] = -torch.inf
    out, grad = _loss(backend, logp, batch.behavior_logp, mask=batch.mask, advantages=torch.ones(7))
    ref, ref_grad = _loss("torch", logp.double(), batch.behavior_logp.double(), mask=batch.mask,
                          advantages=torch.ones(7))
    assert torch.isfinite(out.loss) and torch.all(torch.isfinite(grad))
    assert torch.all(grad[3] == 0)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("is_level", ["sequence", "token"])
def test_zero_weight_units_contribute_exactly_zero(backend, is_level):
    """lp_prox = -inf on a counted token: its unit's weight is 0, so c = 0, while r = exp(lp - lp_prox) would be
    inf; the unit must add exactly 0, not 0 * inf = NaN."""
    batch = random_batch(15, "packed", with_old=True)
    first = int(batch.cu_seqlens[3])
    batch.mask[first] = True
    batch.old_logp, batch.behavior_logp = batch.old_logp.clone(), batch.behavior_logp.clone()
    batch.old_logp[first], batch.behavior_logp[first] = -torch.inf, -1.0
    batch.logp = torch.where(batch.mask, batch.logp.nan_to_num(-1.0), batch.logp)
    want, want_grad = run(batch.to(torch.float64), "torch", is_level=is_level, clip_ratio=(0.2, 0.2))
    got, got_grad = run(batch, backend, is_level=is_level, clip_ratio=(0.2, 0.2))
    assert torch.isfinite(got.loss) and torch.all(torch.isfinite(got_grad))
    assert got_grad[first] == 0
    assert_matches(got, got_grad, want, want_grad, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_masked_out_sequence_with_a_nonfinite_advantage_adds_exactly_zero(backend, layout):
    """Sequence-level weights, no anchor, no trust region (no token pass: every counted token of a sequence has one
    gradient): a sequence the IS mask removes (c_i = 0) whose advantage is NaN (unvalidated, as an internal caller
    may pass; an inf one on a sequence without counted tokens) gets a gradient of exactly 0, in the float64
    reference too (its advantage is zeroed where no token is kept, before autograd: 0 * NaN would be NaN)."""
    batch = random_batch(16, layout, dtype=torch.float64, spread=0.05)
    behavior = batch.behavior_logp.clone()
    rows = []
    for i in (1, 2):  # far outside the mask's band: c = 0
        part = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])) if layout == "packed" else i
        behavior[part] = batch.logp[part] - 5.0
        rows.append(part)
    batch.behavior_logp = behavior
    adv = torch.linspace(-1.0, 1.0, batch.rewards.numel(), dtype=torch.float64)
    adv[1], adv[2] = torch.inf, torch.nan
    kw = batch.kwargs()
    kw.pop("rewards")
    results = {}
    for name in (backend, "torch"):
        logp = batch.logp.clone().requires_grad_()
        out = vk.policy_loss(logp, batch.behavior_logp, advantages=adv, is_correction="mask", is_threshold=2.0,
                             validate=False, backend=name, **kw)
        out.loss.backward()
        results[name] = (out, logp.grad)
    got, got_grad = results[backend]
    want, want_grad = results["torch"]
    for grad in (got_grad, want_grad):
        assert torch.all(grad[rows[0]] == 0) and torch.all(grad[rows[1]] == 0)
        assert torch.all(torch.isfinite(grad))
    assert torch.isfinite(got.loss)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_fp64_behavior_with_fp32_old_logp_keeps_fp64(backend):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    mu = logp - torch.tensor([[1e-9, 3e-9, -2e-9]], dtype=torch.float64)
    old = logp.float()
    s = vk.sequence_stats(logp, mu, old_logp=old, backend=backend).seq_log_weight
    want = (old.double() - mu).sum(1)
    assert s.dtype == torch.float64
    torch.testing.assert_close(s, want, rtol=1e-12, atol=1e-18)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_norm_length_defaults_to_the_padded_length(backend):
    batch = random_batch(16, "padded", dtype=torch.float64)
    a, _ = run(batch, backend, loss_agg_mode="seq-mean-token-sum-norm")
    b, _ = run(batch, backend, loss_agg_mode="seq-mean-token-sum-norm", norm_length=float(batch.logp.shape[1]))
    c, _ = run(batch, backend, loss_agg_mode="seq-mean-token-sum")
    assert a.loss.item() == b.loss.item()
    assert a.loss.item() == pytest.approx(c.loss.item() / batch.logp.shape[1], rel=1e-12)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_group_without_valid_members_has_zero_baseline(backend):
    batch = random_batch(17, "padded")
    batch.group_index = batch.group_index.clone()
    batch.group_index[1] = 5  # sequence 1 is all-masked: group 5 has no valid member
    batch.num_groups = 7  # and group 6 has no member at all
    for advantage in ("opob", "grpo", "rloo"):
        out, _ = run(batch, backend, advantage=advantage)
        assert out.baseline.shape == (7,)
        assert out.baseline[5].item() == 0 and out.baseline[6].item() == 0


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("is_level", ["sequence", "token"])
def test_sequences_longer_than_a_chunk(backend, is_level):
    """Packed sequences of 9000, 1 and 5000 tokens: several of the Triton kernels' 4096-token chunks per
    sequence, whose partial sums are combined; float64, so any lost or doubled chunk shows."""
    g = torch.Generator().manual_seed(21)
    lengths = [9000, 1, 5000]
    n = sum(lengths)
    cu = torch.tensor([0, 9000, 9001, n])
    logp = -torch.rand(n, generator=g, dtype=torch.float64)
    mu = logp + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    old = logp + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.1
    kw = dict(cu_seqlens=cu, mask=mask, old_logp=old, rewards=torch.tensor([1.0, 0.0, 0.5]),
              group_index=torch.tensor([0, 0, 1]), num_groups=2, is_level=is_level, clip_ratio=(0.2, 0.2))
    results = []
    for b in ("torch", backend):
        lp = logp.clone().requires_grad_()
        out = vk.policy_loss(lp, mu, backend=b, **kw)
        out.loss.backward()
        stats = vk.sequence_stats(logp, mu, old_logp=old, mask=mask, cu_seqlens=cu, backend=b)
        results.append((out, lp.grad, stats))
    (want, want_grad, want_stats), (got, got_grad, got_stats) = results
    assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)
    for name in ("seq_log_weight", "seq_length", "seq_kl_k3"):
        torch.testing.assert_close(getattr(got_stats, name), getattr(want_stats, name), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_many_shuffled_groups_match_the_reference(backend):
    # Each group's members are read from the sequences sorted by group: groups interleaved in any order, of
    # uneven sizes, some empty, must give the reference's baselines and advantages for every estimator.
    g = torch.Generator().manual_seed(23)
    b, num_groups = 100, 20
    group_index = torch.randint(0, num_groups - 4, (b,), generator=g)  # the last 4 groups are empty
    logp = -torch.rand(b, 5, generator=g, dtype=torch.float64)
    mu = logp + 0.3 * torch.randn(b, 5, generator=g, dtype=torch.float64)
    kw = dict(rewards=torch.rand(b, generator=g, dtype=torch.float64).round(decimals=1), group_index=group_index,
              num_groups=num_groups, grad_sq_norm=torch.rand(b, generator=g, dtype=torch.float64) + 0.1)
    for advantage in ("opob", "rloo"):
        want, want_grad = _loss("torch", logp, mu, advantage=advantage, **kw)
        got, got_grad = _loss(backend, logp, mu, advantage=advantage, **kw)
        assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)
