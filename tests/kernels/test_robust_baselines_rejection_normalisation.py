"""The options taken from the peers (docs/contract.md): the reference implementation's OPOB aggregations
(`opob_aggregation` "median" / "winsorized_mean"), verl's rejection criteria (`rejection`) and IS batch
normalisation (`is_batch_normalize`). The float64 reference against the loop oracle (tests/support/oracle.py) on fresh
random batches and on edge cases; the C++ op (aggregations, rejection) and the Triton kernels (aggregations)
against the reference in fp64, fp32 and bf16; the criteria and the normalisation against verl's own functions;
the normalisation and the baselines over two gloo ranks; the backends that lack an option refuse it by name.

The weighted quantile of the oracle walks the sorted rewards with a running weight, as the reference
implementation's get_weighted_median / get_weighted_winsorized_mean do (recipe/fully_async_policy/
staleness_utils.py of mit-han-lab/vcpo, which imports verl and Megatron, so it is not loaded here). Those two
functions were run once beside `vcpo_kernels.advantages` (2026-12-02, loaded from a snapshot of that repository
outside this one): on 300 random groups of 1-16 members with tied rewards and every W_j > 0, the median agreed
exactly and the winsorized mean to 1.2e-7 relative (the reference's +1e-8 in its denominator)."""

import math

import pytest
import torch

import vcpo_kernels as vk
from support.batches import random_batch
from support.oracle import oracle
from support.ranks import on_ranks

NEW_CASES = {
    "median": dict(opob_aggregation="median"),
    "median-batch-no-std": dict(opob_aggregation="median", opob_scope="batch", norm_by_std=False),
    "winsorized": dict(opob_aggregation="winsorized_mean"),
    "winsorized-narrow-length-norm": dict(opob_aggregation="winsorized_mean", opob_winsorize_quantiles=(0.3, 0.6),
                                          opob_length_norm=True),
    "median-compat": dict(opob_aggregation="median", reference_compat=True, is_threshold=1.5),
    "reject-token-k1": dict(rejection=(("token_k1", 0.7, 1.5),)),
    "reject-token-k2-k3": dict(rejection=(("token_k2", None, 0.08), ("token_k3", None, 0.1)), is_level="token"),
    "reject-seq-sum": dict(rejection=(("seq_sum_k1", 0.3, 3.0), ("seq_sum_k2", None, 0.8))),
    "reject-seq-mean": dict(rejection=(("seq_mean_k1", 0.8, 1.25), ("seq_mean_k3", None, 0.09)),
                            loss_agg_mode="token-mean"),
    "reject-seq-max": dict(rejection=(("seq_max_k2", None, 0.2), ("seq_max_k3", None, 0.3)), is_correction="mask",
                           is_threshold=3.0),
    "reject-m2": dict(rejection=(("batch_m2", None, 0.05),), is_level="token"),
    "reject-m2-tight-with-k1": dict(rejection=(("batch_m2", None, 0.01), ("token_k1", 0.7, 1.5)),
                                    trust_region="cispo", clip_ratio=(1.0, 0.3), is_correction="mask",
                                    is_threshold=2.0),
    "batch-norm-seq": dict(is_batch_normalize=True, is_threshold=1.5),
    "batch-norm-token-mask": dict(is_batch_normalize=True, is_level="token", is_correction="mask", is_threshold=1.3),
    "batch-norm-reject-clip": dict(is_batch_normalize=True, is_level="token", rejection=(("seq_max_k2", None, 0.3),),
                                   clip_ratio=(0.2, 0.2), is_correction="mask", is_threshold=1.5),
}
KEYS = ("ess", "ess_ratio", "lr_scale", "is_clip_fraction", "mean_is_coef", "kl_k3", "num_tokens", "num_seqs",
        "ppo_clip_fraction", "rejected_fraction")


def _close(a, b, tol=1e-9):
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _run(opts, batch, backend="torch"):
    logp = batch.logp.clone().requires_grad_()
    out = vk.policy_loss(logp, batch.behavior_logp, options=opts, backend=backend, **batch.kwargs())
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(NEW_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_oracle(name, layout, seed):
    opts = vk.PolicyLossOptions(**NEW_CASES[name])
    batch = random_batch(seed, layout, dtype=torch.float64, with_old=seed == 2, spread=0.4, num_seqs=11)
    if seed == 1:  # continuous rewards: no ties
        batch.rewards = torch.rand(batch.rewards.shape, generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.float64)
    out, grad = _run(opts, batch)
    want = oracle(batch.oracle_seqs(), opts, batch.num_groups, opts.norm_length)
    assert _close(out.loss.item(), want["loss"]), (out.loss.item(), want["loss"])
    for key in KEYS:
        assert _close(getattr(out, key).item(), want[key]), (key, getattr(out, key).item(), want[key])
    for key in ("baseline", "advantages"):
        got = getattr(out, key).tolist()
        assert all(_close(a, b) for a, b in zip(got, want[key], strict=True)), (key, got, want[key])
    assert all(_close(a, b) for g, w in zip(batch.token_grads(grad), want["grads"]) for a, b in zip(g, w))
    assert torch.all(grad.reshape(-1)[~batch.counted()] == 0)


def test_cases_reject_something():
    """The rejection cases above reject some tokens and keep others (else they would test nothing)."""
    for name, kw in NEW_CASES.items():
        if "rejection" in kw:
            for seed in (0, 1):
                frac = _run(vk.PolicyLossOptions(**kw), random_batch(seed, "padded", dtype=torch.float64, spread=0.4,
                                                                     num_seqs=11))[0].rejected_fraction.item()
                assert 0 < frac < 1, (name, seed, frac)


def _baseline(aggregation, rewards, log_weight, group, quantiles=(0.05, 0.95), **kw):
    opts = vk.PolicyLossOptions(opob_aggregation=aggregation, opob_winsorize_quantiles=quantiles, **kw)
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(group)
    out = vk.advantages(r, torch.tensor(log_weight, dtype=torch.float64), seq_length=torch.ones_like(r),
                        group_index=g, num_groups=int(g.max()) + 1, options=opts)
    return out.baseline, out.advantages


@pytest.mark.parametrize("aggregation", ["median", "winsorized_mean"])
def test_robust_baselines_edge_cases(aggregation):
    # one-member group, constant rewards, ties: b is exact and the advantages exactly 0 where they must be
    b, adv = _baseline(aggregation, [0.3, 0.7, 0.7, 0.7, 1.0, 2.0], [0.1, -2.0, 3.0, 0.5, -1.0, 0.2],
                       [0, 1, 1, 1, 2, 2])
    assert b[0] == 0.3 and b[1] == 0.7 and adv[0] == 0 and torch.all(adv[1:4] == 0)
    # extreme log weights: finite, and the dominant member decides (W = exp(2 s), max-shifted)
    b, _ = _baseline(aggregation, [0.0, 1.0, 5.0], [1e4, -1e4, 0.0], [0, 0, 0])
    assert b.item() == 0.0
    # every W_j = 0 (s = -inf): the members weigh equally, not the reference's 0
    b, _ = _baseline(aggregation, [1.0, 2.0, 4.0], [-math.inf] * 3, [0, 0, 0])
    want = 2.0 if aggregation == "median" else (1.0 + 2.0 + 4.0) / 3  # 5% / 95% of 3 equal weights: min / max
    assert math.isclose(b.item(), want, rel_tol=1e-15)
    # a NaN weight gives NaN, a group without members 0
    b, _ = _baseline(aggregation, [1.0, 2.0, 3.0], [math.nan, 0.0, 0.0], [0, 0, 2])
    assert math.isnan(b[0]) and b[1] == 0 and b[2] == 3.0


def test_weighted_median_ties_and_halves():
    # equal weights, even count: the lower median (the first reward whose running weight reaches half)
    b, _ = _baseline("median", [4.0, 1.0, 3.0, 2.0], [0.0] * 4, [0] * 4)
    assert b.item() == 2.0
    # brute force on many random groups against a sorted walk
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=g))
        r = torch.randint(0, 3, (n,), generator=g).double().tolist()
        s = (torch.randn(n, generator=g, dtype=torch.float64) * 0.5).tolist()
        w = [math.exp(2 * x) for x in s]
        for q in (0.0, 0.25, 0.5, 1.0):
            b, _ = _baseline("winsorized_mean" if q != 0.5 else "median", r, s, [0] * n, quantiles=(q, q))
            pairs, run, want = sorted(zip(r, w)), 0.0, None
            for ri, wi in pairs:
                run += wi
                if run >= q * sum(w) * (1 - 1e-12):
                    want = ri
                    break
            assert b.item() == pytest.approx(want, abs=1e-12), (r, s, q)


def test_full_quantiles_give_the_weighted_mean():
    g = torch.Generator().manual_seed(1)
    r, s = torch.rand(12, generator=g, dtype=torch.float64).tolist(), torch.randn(12, generator=g).tolist()
    group = [0, 1, 2] * 4
    mean, _ = _baseline("mean", r, s, group)
    wins, _ = _baseline("winsorized_mean", r, s, group, quantiles=(0.0, 1.0))
    torch.testing.assert_close(wins, mean, rtol=1e-13, atol=1e-13)


def test_rejection_edge_cases():
    batch = random_batch(4, "padded", dtype=torch.float64, spread=0.4)
    flat = batch.behavior_logp.reshape(-1).clone()
    flat[torch.nonzero(batch.counted())[0]] = 300.0  # a log ratio of -300 on one token
    batch.behavior_logp = flat.reshape(batch.logp.shape)
    opts = vk.PolicyLossOptions(is_level="token", rejection=(("token_k1", 1e-3, 1e3),))
    out, grad = _run(opts, batch)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    want = oracle(batch.oracle_seqs(), opts.replace(rejection=()), batch.num_groups)  # for the unrejected counts
    assert out.num_tokens.item() == want["num_tokens"] and out.num_seqs.item() == want["num_seqs"]
    assert grad.reshape(-1)[torch.nonzero(batch.counted())[0]] == 0
    # everything rejected: loss and gradient exactly 0, ESS and advantages as without rejection
    out, grad = _run(vk.PolicyLossOptions(rejection=(("seq_max_k2", None, 1e-12),)), batch)
    plain, _ = _run(vk.PolicyLossOptions(), batch)
    assert out.loss.item() == 0 and torch.all(grad == 0) and out.rejected_fraction.item() == 1.0
    assert torch.equal(out.advantages, plain.advantages) and out.ess_ratio == plain.ess_ratio


def test_batch_normalize_all_zero_coefficients():
    batch = random_batch(0, "packed", dtype=torch.float64)
    opts = vk.PolicyLossOptions(is_batch_normalize=True, is_correction="mask", is_threshold=1.0 + 1e-12,
                                is_threshold_low=1.0)
    out, grad = _run(opts, batch)
    assert out.mean_is_coef.item() == 0 and out.loss.item() == 0 and torch.all(grad == 0)


def test_options_are_checked():
    bad = [dict(opob_aggregation="trimmed"), dict(opob_winsorize_quantiles=(0.9, 0.1)),
           dict(opob_winsorize_quantiles=(-0.1, 0.5)), dict(rejection=(("token_k4", None, 1.0),)),
           dict(rejection=(("token_k1", None, 2.0),)), dict(rejection=(("token_k2", 0.5, 2.0),)),
           dict(rejection=(("seq_sum_k1", 2.0, 0.5),)), dict(rejection=(("seq_max_k3", None, -1.0),)),
           dict(rejection=("token_k1",)), dict(is_batch_normalize=1)]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw)).split("_")[0]):
            vk.PolicyLossOptions(**kw)
    assert vk.PolicyLossOptions(rejection=[["token_k1", 0.5, 2]]).rejection == (("token_k1", 0.5, 2.0),)


AGGREGATION_CASES = {k: v for k, v in NEW_CASES.items() if "opob_aggregation" in v and "rejection" not in v}
REJECTION_CASES = {k: v for k, v in NEW_CASES.items() if "rejection" in v}


COMPILED = [b for b in ("cpu", "triton") if b in vk.available_backends("cpu")]


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(REJECTION_CASES))
def test_compiled_rejection_matches_the_reference(name, layout, dtype, backend):
    """The compiled ops' rejection criteria (token ones and M2PO's mask in their token pass, sequence ones before
    it) against the float64 reference: loss, gradient, rejected_fraction and the IS statistics (which leave
    rejection out). Triton runs under its interpreter here: fp32 and one seed of bypass mode and one with old_logp."""
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("the interpreter is slow: fp32 only")
    opts = vk.PolicyLossOptions(**REJECTION_CASES[name])
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    for seed in (range(3) if backend == "cpu" else (1, 2)):
        # float64 values that bf16 / fp32 hold exactly, so that every criterion decides alike on both sides
        batch = random_batch(seed, layout, dtype=dtype, with_old=seed == 2, spread=0.4, num_seqs=11)
        want, want_grad = _run(opts, batch.to(torch.float64))
        got, grad = _run(opts, batch, backend)
        for key in ("loss", "rejected_fraction", "is_clip_fraction", "mean_is_coef", "ppo_clip_fraction"):
            torch.testing.assert_close(getattr(got, key).double(), getattr(want, key), rtol=tol, atol=tol / 10,
                                       msg=key)
        torch.testing.assert_close(grad.double(), want_grad, rtol=tol, atol=tol / 10, equal_nan=True)

# Triton runs under its interpreter here (about 1 ms a program): two of the cases, one seed
AGGREGATION_RUNS = [(name, b) for b in COMPILED for name in AGGREGATION_CASES
                    if b == "cpu" or name in ("median-batch-no-std", "winsorized-narrow-length-norm")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,backend", AGGREGATION_RUNS)
def test_compiled_aggregations_match_the_reference(name, backend, layout, dtype):
    """The C++ op's and the Triton kernels' median and winsorized mean against the float64 reference, on fresh
    batches with ties, constant and one-member groups and an empty sequence, in float64, float32 and bfloat16."""
    opts = vk.PolicyLossOptions(**AGGREGATION_CASES[name])
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    for seed in range(3) if backend == "cpu" else (2,):
        batch = random_batch(seed, layout, dtype=dtype, with_old=seed == 2, spread=0.4, num_seqs=11)
        want, want_grad = _run(opts, batch.to(torch.float64))
        got, grad = _run(opts, batch, backend)
        for key in ("loss", "baseline", "advantages", "ess_ratio", "mean_is_coef"):
            torch.testing.assert_close(getattr(got, key).double(), getattr(want, key), rtol=tol, atol=tol / 10,
                                       msg=key)
        torch.testing.assert_close(grad.double(), want_grad, rtol=tol, atol=tol / 10, equal_nan=True)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("aggregation", ["median", "winsorized_mean"])
def test_compiled_aggregation_edge_cases(aggregation, backend):
    """All-zero, NaN and extreme weights, empty groups: the compiled per-group steps give the reference's
    values."""
    batch = random_batch(6, "packed", dtype=torch.float64, num_seqs=10, groups=4)
    flat = batch.behavior_logp.clone()
    cu = batch.cu().tolist()
    for i, shift in enumerate([1e4, -1e4, 0.0, 300.0, -300.0, 50.0, -math.inf, 2.0, -2.0, 0.5]):
        flat[cu[i]:cu[i + 1]] = batch.logp[cu[i]:cu[i + 1]] - shift / max(cu[i + 1] - cu[i], 1)  # s_i = shift
    batch.behavior_logp = flat
    opts = vk.PolicyLossOptions(opob_aggregation=aggregation, is_correction="none")
    want, _ = _run(opts, batch)
    got, _ = _run(opts, batch, backend)
    torch.testing.assert_close(got.baseline, want.baseline, rtol=1e-10, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(got.advantages, want.advantages, rtol=1e-10, atol=1e-12, equal_nan=True)


def test_batch_normalize_on_every_backend():
    """is_batch_normalize scales the loss outside the kernels: every backend has it."""
    batch = random_batch(2, "packed")
    opts = vk.PolicyLossOptions(is_batch_normalize=True, is_level="token")
    want, want_grad = _run(opts, batch.to(torch.float64))
    for backend in vk.available_backends("cpu"):
        out, grad = _run(opts, batch, backend)
        torch.testing.assert_close(out.loss.double(), want.loss, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(grad.double(), want_grad, rtol=2e-5, atol=2e-6, equal_nan=True)


# verl's own functions on the same inputs (installed with --no-deps, docs/integrations.md).
VERL_RS = [("token_k1", "0.5_4"), ("token_k2", "0.05"), ("token_k3", "0.08"), ("seq_sum_k1", "0.4_3"),
           ("seq_sum_k2", "0.5"), ("seq_sum_k3", "0.6"), ("seq_mean_k1", "0.8_1.3"), ("seq_mean_k2", "0.06"),
           ("seq_mean_k3", "0.07"), ("seq_max_k2", "0.2"), ("seq_max_k3", "0.25"),
           ("token_k1,seq_mean_k3,seq_max_k2", "0.6_1.5,0.07,0.2")]


def _verl_batch(seed, b=9, t=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[1] = False
    mu = -torch.rand(b, t, generator=g, dtype=torch.float64) - 0.1
    lp = mu + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return mask, mu, lp, torch.randn(b, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("rs,threshold", VERL_RS)
def test_rejection_matches_verl(rs, threshold):
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from vcpo.integrations.verl import rejection_entries
    for seed in range(3):
        mask, mu, lp, adv = _verl_batch(seed)
        kept, metrics = compute_rollout_rejection_mask(lp - mu, mask.double(), rs, threshold)
        opts = vk.PolicyLossOptions(is_correction="none", loss_agg_mode="token-mean",
                                    rejection=rejection_entries(rs, threshold))
        out, grad = _run(opts, _Padded(lp, mu, mask, adv))
        # verl divides by (count + 1e-8): 1e-11 apart
        assert abs(out.rejected_fraction.item() - metrics["rollout_rs_masked_fraction"]) < 1e-9
        want = -(adv[:, None] * kept).sum() / mask.sum()  # verl's mask in a token-mean REINFORCE loss
        assert abs(out.loss.item() - want.item()) < 1e-12
        assert torch.equal(grad != 0, (kept != 0) & (adv[:, None] != 0))


def test_verl_k1_bounds_are_on_minus_log_r():
    """verl's "lo_hi" for token_k1 bounds -log r: "0.5_4" keeps 1/4 <= r <= 2 (not 0.5 <= r <= 4)."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask
    log_r = torch.log(torch.tensor([[0.2, 0.3, 1.9, 2.1, 3.0]], dtype=torch.float64))
    kept, _ = compute_rollout_rejection_mask(log_r, torch.ones_like(log_r), "token_k1", "0.5_4")
    assert kept.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]


class _Padded:
    """A padded batch with caller-given advantages, in the shape _run takes."""

    def __init__(self, lp, mu, mask, adv):
        self.logp, self.behavior_logp, self.mask, self.adv = lp, mu, mask, adv

    def kwargs(self):
        return dict(mask=self.mask, advantages=self.adv)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", ["1.3", "2.5"])
def test_batch_normalize_matches_verl(level, threshold):
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    for seed in range(3):
        mask, mu, lp, adv = _verl_batch(seed)
        weights, _ = compute_rollout_correction_weights(lp - mu, mask.double(), level, threshold, True)
        opts = vk.PolicyLossOptions(is_level=level, is_threshold=float(threshold), is_batch_normalize=True,
                                    loss_agg_mode="token-mean")
        out, _ = _run(opts, _Padded(lp, mu, mask, adv))
        # verl's weights times the REINFORCE surrogate; in bypass mode r = 1
        want = -(adv[:, None] * weights * mask).sum() / mask.sum()
        # verl's mean divides by (count + 1e-8): 1e-8 / 8 sequences apart at most
        assert math.isclose(out.loss.item(), want.item(), rel_tol=2e-9, abs_tol=1e-12)


TWO_RANK_CASES = [dict(is_batch_normalize=True, is_level="token", opob_aggregation="median"),
                  dict(is_batch_normalize=True, is_threshold=1.5, opob_aggregation="winsorized_mean",
                       rejection=(("token_k2", None, 0.1),), loss_agg_mode="token-mean")]


def _on_rank(rank):
    import torch.distributed as dist

    import vcpo
    results = []
    for kw in TWO_RANK_CASES:
        batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3, dtype=torch.float64)
        rows = slice(rank * 4, rank * 4 + 4)
        logp = batch.logp[rows].clone().requires_grad_()
        out = vcpo.policy_loss(logp, batch.behavior_logp[rows], mask=batch.mask[rows], rewards=batch.rewards[rows],
                               group_index=batch.group_index[rows], num_groups=batch.num_groups,
                               grad_sq_norm=batch.grad_sq_norm[rows], config=vcpo.VCPOConfig(**kw),
                               process_group=dist.group.WORLD)
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "grad": logp.grad, "baseline": out.baseline})
    return results


@pytest.fixture(scope="module")
def two_ranks():
    """Both cases of TWO_RANK_CASES on two gloo ranks (one launch)."""
    return on_ranks(_on_rank)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(TWO_RANK_CASES)))
def test_two_ranks_equal_one_process(two_ranks, case):
    """Over two gloo ranks the normaliser is the mean over both ranks' units and the robust baselines are the
    whole batch's: the ranks' averaged gradients are one process's on the whole batch."""
    import vcpo
    kw = TWO_RANK_CASES[case]
    ranks = [r[case] for r in two_ranks]
    batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3, dtype=torch.float64)
    logp = batch.logp.clone().requires_grad_()
    whole = vcpo.policy_loss(logp, batch.behavior_logp, config=vcpo.VCPOConfig(**kw), **batch.kwargs())
    whole.loss.backward()
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks]) / 2, logp.grad, rtol=1e-12, atol=1e-14,
                               equal_nan=True)
    torch.testing.assert_close(ranks[0]["baseline"], whole.baseline, rtol=1e-12, atol=1e-14)
    local = vcpo.policy_loss(batch.logp[:4], batch.behavior_logp[:4], mask=batch.mask[:4],
                             advantages=whole.advantages[:4], config=vcpo.VCPOConfig(**kw))
    assert not torch.isclose(local.mean_is_coef, whole.mean_is_coef)  # the rank's own mean would differ
