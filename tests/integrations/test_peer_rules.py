"""vcpo's trust-region rules against verl 0.9.1's own policy losses, in float64 on the CPU (docs/contract.md,
"Trust regions"; the peer formulas: verl/trainer/ppo/core_algos.py). Each test feeds the same padded batch to
verl's registered loss and to vcpo_kernels.policy_loss (backends "torch" and "cpu") and compares the loss, the
gradient w.r.t. the current log-probs on the counted tokens, and, where verl reports the same quantity, the
fraction of tokens the rule acted on.

Mapping (vcpo trust_region ~ verl loss_mode): ppo ~ vanilla (verl always dual-clips with clip_ratio_c, so it is
given to both), gspo ~ gspo, cispo ~ cispo, gmpo ~ geo_mean (verl divides by all B rows), dppo_tv ~ dppo_tv
(verl's clip_ratio_c defaults to a cap of 3: always set), sapo ~ sapo (verl forces seq-mean-token-mean), and
IcePop: vcpo's token-level truncate + token_k1 rejection ~ verl's vanilla with compute_rollout_correction_weights'
"lo_hi" weights. Decoupled mode: vcpo's old_logp is verl's old_log_prob. Bypass mode: vcpo without old_logp
anchors at the behaviour policy, which is verl's old_log_prob in its v1 bypass trainer.

Tolerances: 1e-10 relative where the arithmetic coincides; 1e-7 where verl divides by L_i + 1e-8
(seq-mean-token-mean, and geo_mean's sequence means)."""

import pytest
import torch

verl = pytest.importorskip("verl")  # installed with --no-deps (docs/integrations.md)
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import vcpo_kernels as vk  # noqa: E402

F64 = torch.float64
B, T = 6, 9
BACKENDS = ("torch", "cpu")
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")  # norm: the padded T
EXACT = dict(rtol=1e-10, atol=1e-13)
EPS_L = dict(rtol=1e-7, atol=1e-12)  # verl: (sum over the row) / (L_i + 1e-8)


def tolerance(mode):
    return EPS_L if mode == "seq-mean-token-mean" else EXACT


def batch(seed, spread, empty_row=None):
    """Ragged mask (row 0 full, the others 3..T tokens), old log-probs, current log-probs `spread` away from them,
    behaviour log-probs `spread` away on the other side, one advantage per row (alternating signs). Padding holds
    finite values (verl's seq-mean modes multiply by the mask, so a NaN there would poison verl)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T, (B,), generator=g)
    lengths[0] = T
    if empty_row is not None:
        lengths[empty_row] = 0
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -1.5 * torch.rand(B, T, generator=g, dtype=F64) - 0.05
    lp = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    mu = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.rand(B, generator=g, dtype=F64) + 0.1
    adv[1::2] *= -1
    return mask, old, lp, mu, adv


def verl_loss(name, anchor, lp, adv, mask, mode, weights=None, **fields):
    """verl's registered loss `name` with old_log_prob = anchor: (loss, grad w.r.t. lp, metrics)."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    x = lp.clone().requires_grad_()
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=anchor, log_prob=x, advantages=adv[:, None].expand(B, T).clone(), response_mask=mask.to(F64),
        loss_agg_mode=mode, config=config, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), x.grad, metrics


def vcpo_loss(backend, lp, mu, old, adv, mask, **options):
    """vcpo's fused loss (old None: bypass mode): (result, grad w.r.t. lp); the gradient is exactly 0 on padding."""
    x = lp.clone().requires_grad_()
    options = {"is_correction": "none", **options}
    out = vk.policy_loss(x, mu, old_logp=old, mask=mask, advantages=adv, backend=backend, lr_rule=None, **options)
    out.loss.backward()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    return out, x.grad


def assert_same(ours, theirs, mask, tol, factor=1.0):
    """vcpo's (loss, grad) times `factor` against verl's, the gradient on the counted tokens."""
    (out, grad), (loss, vgrad, _) = ours, theirs
    torch.testing.assert_close(factor * out.loss.detach(), loss, **tol)
    torch.testing.assert_close(factor * grad[mask], vgrad[mask], **tol)


def inputs(bypass, seed, spread):
    """(mask, anchor verl reads, lp, vcpo's behavior_logp, vcpo's old_logp, adv). Decoupled: the ratio is pi/old
    and vcpo's behaviour policy is a third one (is_correction="none": its weights are 1), so a vcpo that anchored
    at mu would fail. Bypass: vcpo has no old_logp and anchors at mu; verl's old_log_prob is mu."""
    mask, old, lp, mu, adv = batch(seed, spread)
    return (mask, mu, lp, mu, None, adv) if bypass else (mask, old, lp, mu, old, adv)


# (id, vcpo options, verl loss, verl ActorConfig fields, seed, log-ratio spread, verl metrics vcpo's
# ppo_clip_fraction equals (their sum), verl metric that must be > 0 to show a second branch acted)
CLIPPED = [
    ("ppo", dict(trust_region="ppo", clip_ratio=(0.2, 0.28), clip_ratio_c=1.5), "vanilla",
     dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5), 11, 0.5,
     ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"), "actor/pg_clipfrac_lower"),  # dual clip acted
    ("gspo", dict(trust_region="gspo", clip_ratio=(0.05, 0.06)), "gspo",
     dict(clip_ratio_low=0.05, clip_ratio_high=0.06), 12, 0.3, ("actor/pg_clipfrac",), None),
    ("cispo-upper", dict(trust_region="cispo", clip_ratio=(10.0, 0.2)), "cispo",
     dict(clip_ratio_low=10.0, clip_ratio_high=0.2), 13, 0.5, ("actor/pg_clipfrac",), None),
    ("cispo-both", dict(trust_region="cispo", clip_ratio=(0.15, 0.2)), "cispo",
     dict(clip_ratio_low=0.15, clip_ratio_high=0.2), 14, 0.5, ("actor/pg_clipfrac",), None),
    ("dppo_tv-capped", dict(trust_region="dppo_tv", clip_ratio=(0.1, 0.15), clip_ratio_c=1.5), "dppo_tv",
     dict(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5), 15, 0.5,
     ("actor/pg_clipfrac",), "actor/pg_clipfrac_lower"),  # verl's "lower" is the rate of r > cap on kept tokens
    ("dppo_tv", dict(trust_region="dppo_tv", clip_ratio=(0.1, 0.15)), "dppo_tv",
     dict(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1e4), 16, 0.5, ("actor/pg_clipfrac",), None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
@pytest.mark.parametrize("rule,ours,name,fields,seed,spread,fractions,second", CLIPPED, ids=[c[0] for c in CLIPPED])
def test_clipped_rules_equal_verls(rule, ours, name, fields, seed, spread, fractions, second, bypass, mode, backend):
    """ppo, gspo, cispo (one- and two-sided), dppo_tv (capped and not) against verl's loss of the same name in
    each of verl's aggregation modes but token-sum, decoupled and bypass: loss, gradient and clip fraction."""
    mask, anchor, lp, mu, old, adv = inputs(bypass, seed, spread)
    out, grad = vcpo_loss(backend, lp, mu, old, adv, mask, loss_agg_mode=mode, **ours)
    theirs = verl_loss(name, anchor, lp, adv, mask, mode, **fields)
    assert_same((out, grad), theirs, mask, tolerance(mode))
    metrics = theirs[2]
    frac = float(out.ppo_clip_fraction)
    assert 0 < frac < 1
    assert frac == pytest.approx(sum(metrics[k] for k in fractions), rel=1e-8)  # verl: / (count + 1e-8)
    if second is not None:
        assert metrics[second] > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
def test_gmpo_equals_verls_geo_mean(bypass, backend):
    """GMPO (log-space clip on the advantage's side, geometric mean per sequence) against verl's geo_mean, whose
    plain mean over the B rows is vcpo's seq-mean-token-mean when no row is fully masked."""
    mask, anchor, lp, mu, old, adv = inputs(bypass, 21, 0.5)
    out, grad = vcpo_loss(backend, lp, mu, old, adv, mask, trust_region="gmpo", clip_ratio=(0.3, 0.4),
                          loss_agg_mode="seq-mean-token-mean")
    theirs = verl_loss("geo_mean", anchor, lp, adv, mask, "seq-mean-token-mean", clip_ratio_low=0.3,
                       clip_ratio_high=0.4)
    assert_same((out, grad), theirs, mask, EPS_L)
    assert 0 < float(out.ppo_clip_fraction) < 1
    assert theirs[2]["actor/pg_clipfrac"] > 0 and theirs[2]["actor/pg_clipfrac_lower"] > 0  # both sides acted


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmpo_with_a_fully_masked_row_is_verls_times_b_over_b_valid(backend):
    """The documented difference: verl's geo_mean divides by every row (B = 6, one of them empty), vcpo by the
    valid sequences (B' = 5), so verl's loss and gradient are B'/B times vcpo's."""
    mask, old, lp, mu, adv = batch(22, 0.5, empty_row=3)
    out, grad = vcpo_loss(backend, lp, mu, old, adv, mask, trust_region="gmpo", clip_ratio=(0.3, 0.4),
                          loss_agg_mode="seq-mean-token-mean")
    theirs = verl_loss("geo_mean", old, lp, adv, mask, "seq-mean-token-mean", clip_ratio_low=0.3,
                       clip_ratio_high=0.4)
    assert int(out.num_seqs) == B - 1
    assert_same((out, grad), theirs, mask, EPS_L, factor=(B - 1) / B)
    assert abs(float(out.loss.detach()) - float(theirs[0])) > 1e-3 * abs(float(theirs[0]))  # the factor is not 1 here


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
@pytest.mark.parametrize("tau", [(1.0, 1.05), (0.7, 2.0)], ids=["paper", "wide"])
def test_sapo_equals_verls(tau, bypass, backend):
    """SAPO's soft gate against verl's sapo (which aggregates with seq-mean-token-mean whatever it is told)."""
    mask, anchor, lp, mu, old, adv = inputs(bypass, 31, 0.6)
    out, grad = vcpo_loss(backend, lp, mu, old, adv, mask, trust_region="sapo", sapo_tau=tau,
                          loss_agg_mode="seq-mean-token-mean")
    theirs = verl_loss("sapo", anchor, lp, adv, mask, "seq-mean-token-mean", tau_pos=tau[0], tau_neg=tau[1])
    assert_same((out, grad), theirs, mask, EPS_L)
    # the gate is not the identity here: plain PPO without a clip has another gradient
    plain, plain_grad = vcpo_loss(backend, lp, mu, old, adv, mask, trust_region="none",
                                  loss_agg_mode="seq-mean-token-mean")
    assert not torch.allclose(plain_grad[mask], grad[mask], rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_icepop_equals_verls_vanilla_with_lo_hi_weights(mode, backend):
    """IcePop: verl's token weights exp(old - mu) kept in [alpha, beta] and 0 outside, multiplying vanilla PPO's
    per-token loss (the response mask, hence every denominator, unchanged), against vcpo's token-level truncate at
    beta with token_k1 rejection (alpha, beta), whose rejected tokens also stay in the denominators."""
    alpha, beta = 0.6, 1.5
    mask, old, lp, mu, adv = batch(41, 0.5)
    weights, metrics = compute_rollout_correction_weights(log_ratio=old - mu, response_mask=mask.to(F64),
                                                          rollout_is="token", rollout_is_threshold=f"{alpha}_{beta}")
    out, grad = vcpo_loss(backend, lp, mu, old, adv, mask, trust_region="ppo", clip_ratio=(0.2, 0.28),
                          clip_ratio_c=1.5, is_level="token", is_correction="truncate", is_threshold=beta,
                          rejection=(("token_k1", alpha, beta),), loss_agg_mode=mode)
    theirs = verl_loss("vanilla", old, lp, adv, mask, mode, weights=weights, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, clip_ratio_c=1.5)
    assert_same((out, grad), theirs, mask, tolerance(mode))
    rejected = float(out.rejected_fraction)
    assert 0 < rejected < 1 and rejected == pytest.approx(metrics["rollout_is_oob_ratio"], rel=1e-8)
    kept = mask & (weights > 0)
    assert not torch.allclose(weights[kept], torch.ones_like(weights[kept]), rtol=1e-2)  # in band: weighted by w
    assert 0 < float(out.ppo_clip_fraction) < 1
