"""The trust regions beyond the option cases of test_backends_vs_reference.py: their option checks, the bypass-mode
refusal, the token-form gradients against finite differences, extreme and zero ratios, tokens outside the sampling
support and half-precision inputs (values in masked positions: test_edge_cases.py)."""

import math

import pytest
import torch

import vcpo_kernels as vk
from support.backend_check import COMPILED_BACKENDS, assert_matches, run
from support.batches import random_batch

ALL_BACKENDS = ["torch"] + COMPILED_BACKENDS
RULES = {  # every rule, with options that make it act on some tokens of random_batch and not on others
    "ppo": dict(clip_ratio=(0.1, 0.1), clip_ratio_c=1.2),
    "gspo": dict(trust_region="gspo", clip_ratio=(0.03, 0.04), clip_ratio_c=1.05),
    "gmpo": dict(trust_region="gmpo", clip_ratio=(0.1, 0.15)),
    "cispo": dict(trust_region="cispo", clip_ratio=(0.1, 0.2)),
    "dppo_tv": dict(trust_region="dppo_tv", clip_ratio=(0.02, 0.03), clip_ratio_c=1.1),
    "sapo": dict(trust_region="sapo", sapo_tau=(0.8, 1.3)),
}


@pytest.mark.parametrize("options,message", [
    (dict(trust_region="trpo"), "trust_region must be one of"),
    (dict(trust_region="gspo"), "'gspo' needs clip_ratio"),
    (dict(trust_region="ppo"), "'ppo' needs clip_ratio"),
    (dict(trust_region="sapo", clip_ratio=(0.2, 0.2)), "clip_ratio is not read by trust_region='sapo'"),
    (dict(trust_region="none", clip_ratio=(0.2, 0.2)), "clip_ratio is not read by trust_region='none'"),
    (dict(trust_region="cispo", clip_ratio=(0.2, 0.2), clip_ratio_c=2.0), "not an option of trust_region='cispo'"),
    (dict(clip_ratio_c=2.0), "not an option of trust_region='none'"),
    (dict(trust_region="gspo", clip_ratio=(1.0, 0.2)), "eps_low must be < 1 for trust_region='gspo'"),
    (dict(sapo_tau=(1.0, 2.0)), "sapo_tau is read by trust_region='sapo' only"),
    (dict(trust_region="sapo", sapo_tau=(0.0, 1.0)), "sapo_tau tau_pos must be a finite number > 0"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        vk.PolicyLossOptions(**options)


def test_wide_lower_bounds_are_allowed_where_they_mean_off():
    """CISPO's and DPPO's lower bound >= 1 is "no lower bound" (1 - eps <= 0; a probability drop beyond 1)."""
    assert vk.PolicyLossOptions(trust_region="cispo", clip_ratio=(10.0, 0.2)).clip_ratio == (10.0, 0.2)
    assert vk.PolicyLossOptions(trust_region="dppo_tv", clip_ratio=(1.0, 0.2)).clip_ratio == (1.0, 0.2)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_bypass_mode_refuses_the_truncating_correction(backend, rule):
    batch = random_batch(3, "padded")
    with pytest.raises(ValueError, match="is_correction='truncate' would weight each unit a second time"):
        vk.policy_loss(batch.logp, batch.behavior_logp, backend=backend, **batch.kwargs(), **RULES[rule])
    with_old = random_batch(3, "padded", with_old=True)  # with old_logp the correction is on pi_old / mu: allowed
    vk.policy_loss(with_old.logp, with_old.behavior_logp, backend=backend, **with_old.kwargs(), **RULES[rule])


def _loss_with_given_advantages(logp, batch, options):
    """The loss with fixed advantages (OPOB's would move with logp in bypass mode, through s_i)."""
    kw = batch.kwargs()
    kw.pop("rewards")
    adv = torch.linspace(-1.0, 1.3, batch.rewards.numel(), dtype=torch.float64)
    return vk.policy_loss(logp, batch.behavior_logp, backend="torch", **kw, advantages=adv, is_correction="none",
                          **options).loss


@pytest.mark.parametrize("rule", ["ppo", "gspo", "gmpo", "sapo"])
@pytest.mark.parametrize("with_old", [False, True])
def test_token_forms_are_the_gradient_of_the_loss(rule, with_old):
    """GSPO's and GMPO's token forms (each token's gradient carries its sequence's ratio), PPO's ratio pi / mu in
    bypass mode and SAPO's gate: with sequence-level coefficients their gradient is the true one, so it equals
    central finite differences of the loss value (float64; inputs drawn off the clip kinks)."""
    batch = random_batch(31, "padded", dtype=torch.float64, with_old=with_old)
    options = dict(RULES[rule])
    if rule in ("ppo", "gspo"):
        options.pop("clip_ratio_c")

    def loss_at(lp):
        return _loss_with_given_advantages(lp, batch, options)

    logp = batch.logp.clone().requires_grad_()
    loss_at(logp).backward()
    h, mask = 1e-6, batch.mask
    numeric = torch.zeros_like(logp)
    for idx in mask.nonzero():
        up, down = batch.logp.clone(), batch.logp.clone()
        up[tuple(idx)] += h
        down[tuple(idx)] -= h
        numeric[tuple(idx)] = (loss_at(up) - loss_at(down)) / (2 * h)
    got = torch.where(mask, logp.grad, 0)
    assert got.abs().max() > 1e-3  # the rule leaves some gradient
    torch.testing.assert_close(got, numeric, rtol=1e-5, atol=1e-8)


def _extreme(with_old: bool):
    """A batch whose log ratios log pi - log pi_anchor reach +-30 per token (sequence ratios e^300)."""
    batch = random_batch(41, "padded", dtype=torch.float64, with_old=with_old)
    g = torch.Generator().manual_seed(41)
    jump = 30 * (2 * torch.rand(batch.logp.shape, generator=g, dtype=torch.float64) - 1)
    if with_old:
        batch.old_logp = batch.logp - jump
    else:
        batch.behavior_logp = batch.logp - jump
    return batch


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("with_old", [False, True])
def test_extreme_ratios_match_the_reference(backend, rule, with_old):
    """Ratios up to e^30 a token: every bounded rule (dual clip, capped weights, SAPO's gate) stays finite, and
    GMPO (unbounded for A < 0) agrees with the reference, infinities included."""
    batch = _extreme(with_old)
    options = dict(RULES[rule], is_correction="none")
    want, want_grad = run(batch, "torch", **options)
    got, got_grad = run(batch, backend, **options)
    if rule != "gmpo":
        assert torch.isfinite(got.loss) and torch.all(torch.isfinite(got_grad))
    assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_a_token_outside_the_support_adds_nothing(backend, rule):
    """lp = -inf on a counted token (outside the trainer's sampling support) under each rule in bypass mode, with a
    correction that keeps its unit (none): finite loss and gradient, a zero gradient on that token, the same
    results as the reference."""
    batch = random_batch(43, "padded", dtype=torch.float64)
    row = 4
    col = int(batch.mask[row].nonzero()[0, 0])
    batch.logp = batch.logp.clone()
    batch.logp[row, col] = -torch.inf
    want, want_grad = run(batch, "torch", **RULES[rule], is_correction="none")
    got, got_grad = run(batch, backend, **RULES[rule], is_correction="none")
    assert torch.isfinite(got.loss) and torch.all(torch.isfinite(got_grad))
    assert got_grad[row, col] == 0
    assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(backend, rule, low):
    """bf16/fp16 logp, behaviour and old log-probs: fp32 accumulation, the gradient in logp's dtype, within 1e-2 of
    the float64 reference on the same rounded values."""
    batch = random_batch(53, "padded", with_old=True).to(low)
    want, want_grad = run(batch.to(torch.float64), "torch", **RULES[rule])
    got, got_grad = run(batch, backend, **RULES[rule])
    assert got_grad.dtype == low and got.loss.dtype == torch.float32
    assert_matches(got, got_grad.float(), want, want_grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch"] + COMPILED_BACKENDS)
def test_m2po_mask_edges(backend):
    """batch_m2 where every token passes (a bound above the whole batch's mean: nothing masked), where none can (a
    bound below the smallest value: every token masked, the rest empty) and with a NaN Delta (masked), against the
    reference; the loss and gradient stay finite."""
    batch = random_batch(59, "padded", dtype=torch.float64)
    for bound, want_fraction in ((1e6, 0.0), (1e-12, 1.0)):
        got, grad = run(batch, backend, rejection=(("batch_m2", None, bound),))
        assert got.rejected_fraction.item() == want_fraction
        assert torch.isfinite(got.loss) and torch.all(torch.isfinite(grad))
        if want_fraction == 1.0:
            assert got.loss.item() == 0 and torch.all(grad == 0)
    nan = batch.behavior_logp.clone()
    row = 4
    col = int(batch.mask[row].nonzero()[0, 0])
    nan[row, col] = torch.nan
    batch.behavior_logp = nan
    adv = torch.linspace(-1.0, 1.0, batch.rewards.numel(), dtype=torch.float64)  # OPOB's would be NaN in its group
    want, want_grad = run(batch, "torch", advantages=adv, rejection=(("batch_m2", None, 0.05),), is_level="token")
    got, got_grad = run(batch, backend, advantages=adv, rejection=(("batch_m2", None, 0.05),), is_level="token")
    assert got_grad[row, col] == 0 and 0 < got.rejected_fraction.item() < 1
    assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch"] + COMPILED_BACKENDS)
def test_m2po_given_threshold(backend):
    """second_moment_threshold given (a data-parallel group's): the batch's own threshold reproduces the computed
    mask; another one masks exactly the counted tokens with Delta^2 at or above it (a brute-force count), with the
    loss and gradient of the reference given the same; +inf masks none."""
    batch = random_batch(61, "padded", dtype=torch.float64, spread=0.6)
    m2 = dict(rejection=(("batch_m2", None, 0.05),), is_level="token")
    delta = (batch.logp - batch.behavior_logp)[batch.mask]
    v = torch.sort(delta * delta, descending=True).values
    own = float(v[int(torch.nonzero(torch.stack([v[k:].mean() <= 0.05 for k in range(v.numel())]))[0]) - 1])
    computed, computed_grad = run(batch, backend, **m2)
    given, given_grad = run(batch, backend, second_moment_threshold=own, **m2)
    assert_matches(given, given_grad, computed, computed_grad, rtol=1e-12, atol=0)
    for threshold in (float(v[v.numel() // 3]), math.inf):
        got, got_grad = run(batch, backend, second_moment_threshold=threshold, **m2)
        want, want_grad = run(batch, "torch", second_moment_threshold=threshold, **m2)
        assert got.rejected_fraction.item() == pytest.approx(float((v >= threshold).sum()) / v.numel(), abs=1e-12)
        assert_matches(got, got_grad, want, want_grad, rtol=1e-10, atol=1e-12)


def test_m2po_given_threshold_is_checked():
    with pytest.raises(ValueError, match="second_moment_threshold is the threshold of rejection 'batch_m2'"):
        vk.PolicyLossOptions(second_moment_threshold=0.1)
    for bad in (-1.0, math.nan, True, "0.1"):
        with pytest.raises(ValueError, match="second_moment_threshold must be a number >= 0"):
            vk.PolicyLossOptions(rejection=(("batch_m2", None, 0.05),), second_moment_threshold=bad)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_m2po_threshold_agrees_at_the_bound_in_fp32(backend):
    """fp32 inputs with the bound set to a rest mean exactly: Delta in fp32, its square and the order statistic in
    float64 on every backend, so the float32 reference and the compiled op mask the same tokens."""
    for seed in range(8):
        batch = random_batch(seed, "packed", spread=0.4, num_seqs=9)
        counted = batch.mask if batch.mask is not None else torch.ones_like(batch.logp, dtype=torch.bool)
        d = (batch.logp - batch.behavior_logp)[counted].double()
        v = torch.sort(d * d, descending=True).values
        bound = float(v[3:].mean())  # the rest after the 3 largest: a tie with the criterion's <=
        want, want_grad = run(batch, "torch", rejection=(("batch_m2", None, bound),), is_level="token")
        got, got_grad = run(batch, backend, rejection=(("batch_m2", None, bound),), is_level="token")
        assert got.rejected_fraction.item() == want.rejected_fraction.item()
        assert_matches(got, got_grad, want, want_grad, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_nan_log_ratio_and_overflow_agree_with_the_reference(backend):
    """A NaN log ratio under GMPO stays NaN (it is not clipped to a bound), a ratio that overflows under SAPO has a
    zero slope, and a removed unit with a NaN advantage takes no clip branch: every backend as the reference."""
    batch = random_batch(61, "padded", dtype=torch.float64, with_old=True)
    row, col = 4, int(batch.mask[4].nonzero()[0, 0])
    nan_old = batch.old_logp.clone()
    nan_old[row, col] = torch.nan
    cases = [dict(trust_region="gmpo", clip_ratio=(0.1, 0.15), is_correction="none"),
             dict(trust_region="sapo", is_correction="none"),
             dict(clip_ratio=(0.2, 0.2), is_correction="mask", is_threshold=1.3)]
    for options in cases:
        b = random_batch(61, "padded", dtype=torch.float64, with_old=True)
        b.old_logp, b.behavior_logp = b.old_logp.clone(), b.behavior_logp.clone()
        if options.get("trust_region") == "gmpo":
            b.old_logp = nan_old
        elif options.get("trust_region") == "sapo":  # lp - lp_old = +inf: rho overflows
            b.old_logp[row, col] = -torch.inf
        else:  # mu = -inf: s = +inf, its unit masked (c = 0) and its group's OPOB advantages NaN
            b.behavior_logp[row, col] = -torch.inf
        want, want_grad = run(b, "torch", **options)
        got, got_grad = run(b, backend, **options)
        for name in ("loss", "ppo_clip_fraction"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), equal_nan=True, msg=name)
        torch.testing.assert_close(got_grad, want_grad, equal_nan=True, rtol=1e-10, atol=1e-12)
