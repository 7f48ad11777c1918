"""Leave-one-out OPOB (opob_leave_one_out, docs/contract.md "Advantages"): every backend against a brute force
over i and j != i, on the cases where a careless formula fails: one weight 1e30 times the others, one-member
groups, all other weights zero, extreme log-ratios, empty sequences, NaN weights; and opob_max_share."""

import math

import pytest
import torch

import vcpo_kernels as vk
from support.backend_check import COMPILED_BACKENDS, assert_matches, run
from support.batches import random_batch
from support.oracle import leave_one_out_baseline, oracle

ALL_BACKENDS = ["torch"] + COMPILED_BACKENDS
LOO = dict(opob_leave_one_out=True)


def brute_force(log_w: list, rewards: list, groups: list) -> list:
    """b_-i by a plain loop over i and j != i of i's group, each weight shifted by the max over the others (so any
    log weight is exact); None where i has no other member (its advantage is 0)."""
    out = []
    for i in range(len(rewards)):
        others = [j for j in range(len(rewards)) if j != i and groups[j] == groups[i]]
        if not others:
            out.append(None)
            continue
        top = max(log_w[j] for j in others)
        if top == -math.inf:
            out.append(sum(rewards[j] for j in others) / len(others))
            continue
        w = [math.exp(log_w[j] - top) for j in others]
        out.append(sum(wj * rewards[j] for wj, j in zip(w, others)) / sum(w))
    return out


def one_token_loss(backend, s, rewards, groups, grad_sq=None, **options):
    """The fused loss on sequences of one token with log weight s_i (logp = s, behaviour 0: s exact), A_i = R_i - b."""
    s = torch.as_tensor(s, dtype=torch.float64)
    return vk.policy_loss(s[:, None].clone(), torch.zeros(len(s), 1, dtype=torch.float64),
                          rewards=torch.as_tensor(rewards, dtype=torch.float64),
                          group_index=torch.as_tensor(groups), grad_sq_norm=grad_sq, backend=backend,
                          norm_by_std=False, **LOO, **options)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_dominant_weight_is_exact(backend, scope):
    """w^2 of one sequence 1e30 times the others' (log weights ~35 apart): every b_-i equals the brute force over
    the others to 1e-12 relative, the dominant sequence's too, where sum W - W_i leaves nothing but rounding."""
    gen = torch.Generator().manual_seed(5)
    s = (0.3 * torch.randn(12, generator=gen, dtype=torch.float64)).tolist()
    s[3] = s[3] + 0.5 * math.log(1e30)  # W_3 = w_3^2 is 1e30 times the others'
    s[9] = s[9] + 0.5 * math.log(1e30) + 2.0  # and one in the other group
    rewards = torch.rand(12, generator=gen, dtype=torch.float64).tolist()
    groups = [0] * 6 + [1] * 6
    out = one_token_loss(backend, s, rewards, groups, opob_scope=scope)
    want = brute_force([2 * x for x in s], rewards, groups if scope == "group" else [0] * 12)
    got = [r - a for r, a in zip(rewards, out.advantages.tolist())]
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=1e-12, abs_tol=0), (i, g, w)
    # What the test guards against: the dominant sequence's sum of the others as sum W - W_i leaves nothing.
    w_all = [math.exp(2 * x - 2 * s[3]) for x in s[:6]]
    assert sum(w_all) - w_all[3] == 0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_one_member_groups_have_zero_advantage(backend):
    out = one_token_loss(backend, [0.5, -2.0, 30.0], [1.0, 0.0, 0.3], [0, 1, 2])
    assert torch.equal(out.advantages, torch.zeros(3, dtype=torch.float64))
    assert out.opob_max_share.item() == 1.0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_other_weights_zero(backend):
    """G_j = 0: in group 0 only sequence 0 weighs (its others all 0: their plain mean; theirs: R_0); in group 1
    nobody weighs (every b_-i the plain mean of the others, the RLOO baseline)."""
    rewards = [0.9, 0.1, 0.4, 0.7, 1.0, 0.0, 0.25]
    groups = [0, 0, 0, 0, 1, 1, 1]
    grad_sq = torch.tensor([2.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    out = one_token_loss(backend, [0.1, -0.3, 0.2, 0.0, 1.0, -1.0, 0.5], rewards, groups, grad_sq)
    want = [0.4, 0.9, 0.9, 0.9, 0.125, 0.625, 0.5]
    torch.testing.assert_close(out.advantages, torch.tensor(rewards, dtype=torch.float64) - torch.tensor(
                               want, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)
    assert out.opob_max_share.item() == 1.0  # group 0: all of the weight on sequence 0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("scale", [100.0, 1e4])
def test_extreme_log_ratios(backend, scale):
    gen = torch.Generator().manual_seed(int(scale))
    s = (scale * torch.randn(16, generator=gen, dtype=torch.float64)).tolist()
    rewards = torch.rand(16, generator=gen, dtype=torch.float64).tolist()
    groups = [i % 3 for i in range(16)]
    out = one_token_loss(backend, s, rewards, groups)
    want = brute_force([2 * x for x in s], rewards, groups)
    got = [r - a for r, a in zip(rewards, out.advantages.tolist())]
    assert all(math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-15) for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_weight_gives_nan_in_its_group_only(backend, bad):
    out = one_token_loss(backend, [0.1, bad, 0.3, 0.2, -0.4], [1.0, 0.0, 0.5, 0.3, 0.9], [0, 0, 0, 1, 1])
    assert torch.isnan(out.advantages[:3]).all() and torch.isfinite(out.advantages[3:]).all()
    assert math.isnan(out.opob_max_share.item())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_random_batches_match_the_oracle(backend, layout, scope):
    """Masked and empty sequences, a one-member group, non-contiguous groups (random_batch), in float64."""
    opts = vk.PolicyLossOptions(opob_scope=scope, **LOO)
    batch = random_batch(17, layout, dtype=torch.float64)
    out = vk.policy_loss(batch.logp, batch.behavior_logp, options=opts, backend=backend, **batch.kwargs())
    want = oracle(batch.oracle_seqs(), opts, batch.num_groups)
    torch.testing.assert_close(out.advantages, torch.tensor(want["advantages"], dtype=torch.float64), rtol=1e-10,
                               atol=1e-12)
    assert math.isclose(out.opob_max_share.item(), want["opob_max_share"], rel_tol=1e-12)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float32])
def test_low_precision_inputs(backend, low):
    batch = random_batch(23, "packed", with_old=True).to(low)
    want, want_grad = run(batch.to(torch.float64), "torch", **LOO)
    got, got_grad = run(batch, backend, **LOO)
    tol = dict(rtol=1e-2, atol=1e-4) if low == torch.bfloat16 else dict(rtol=2e-5, atol=2e-6)
    assert_matches(got, got_grad.float(), want, want_grad, **tol)
    torch.testing.assert_close(got.opob_max_share.double(), want.opob_max_share, **tol)


def test_reference_gradient():
    """The baseline is a constant, as the plug-in's (contract, "Loss"): gradcheck of the loss in logp, with a
    recomputed proximal policy so that the weights, and so b_-i, do not move with logp."""
    batch = random_batch(29, "packed", dtype=torch.float64, with_old=True)
    kw = batch.kwargs()

    def loss(logp):
        return vk.policy_loss(logp, batch.behavior_logp, backend="torch", **kw, **LOO).loss

    assert torch.autograd.gradcheck(loss, (batch.logp.clone().requires_grad_(),))


def test_plug_in_is_the_shrunk_leave_one_out():
    """R_i - b = (1 - s_i) (R_i - b_-i), s_i = W_i / sum W over i's group: the plug-in silences the dominant."""
    batch = random_batch(31, "padded", dtype=torch.float64)
    kw = dict(backend="torch", norm_by_std=False, **batch.kwargs())
    plug = vk.policy_loss(batch.logp, batch.behavior_logp, **kw)
    loo = vk.policy_loss(batch.logp, batch.behavior_logp, **kw, **LOO)
    length = vk.sequence_stats(batch.logp, batch.behavior_logp, mask=batch.mask).seq_length
    w = torch.where(length > 0, torch.exp(2 * plug.seq_log_weight) * batch.grad_sq_norm.double(), 0)
    share = w / torch.zeros(batch.num_groups, dtype=torch.float64).index_add_(0, batch.group_index, w)[
        batch.group_index]
    torch.testing.assert_close(plug.advantages, (1 - share.nan_to_num()) * loo.advantages, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_max_share_of_every_estimator(backend):
    """opob_max_share is the same for every OPOB variant (plug-in, leave-one-out, median), 0 for the others (over
    the batch: random_batch has a one-member group, whose share is 1)."""
    batch = random_batch(37, "packed", dtype=torch.float64)
    shares = {}
    for name, opts in {"plug-in": {}, "loo": LOO, "median": dict(opob_aggregation="median"),
                       "grpo": dict(advantage="grpo")}.items():
        if name == "median" and backend not in ("torch", "cpu", "triton"):
            continue
        out = vk.policy_loss(batch.logp, batch.behavior_logp, backend=backend, opob_scope="batch", **batch.kwargs(),
                             **opts)
        shares[name] = out.opob_max_share.item()
    want = oracle(batch.oracle_seqs(), vk.PolicyLossOptions(opob_scope="batch"), batch.num_groups)["opob_max_share"]
    assert 0 < want < 1 and shares.pop("grpo") == 0
    assert all(math.isclose(x, want, rel_tol=1e-12) for x in shares.values()), shares


def test_advantages_op_matches_the_fused_loss():
    """vcpo_kernels.advantages (the data-parallel path) forms the same leave-one-out advantages."""
    batch = random_batch(41, "packed", dtype=torch.float64)
    opts = vk.PolicyLossOptions(**LOO)
    out = vk.policy_loss(batch.logp, batch.behavior_logp, options=opts, backend="torch", **batch.kwargs())
    stats = vk.sequence_stats(batch.logp, batch.behavior_logp, mask=batch.mask, cu_seqlens=batch.cu_seqlens)
    adv = vk.advantages(batch.rewards, stats.seq_log_weight, seq_length=stats.seq_length,
                        grad_sq_norm=batch.grad_sq_norm, group_index=batch.group_index, num_groups=batch.num_groups,
                        options=opts)
    torch.testing.assert_close(adv.advantages, out.advantages, rtol=0, atol=0)


def test_oracle_brute_force_cases():
    assert leave_one_out_baseline([1.0], [5.0], 0) == 1.0  # no other member: R_i, advantage 0
    assert leave_one_out_baseline([1.0, 0.0, 0.5], [1.0, 0.0, 0.0], 0) == 0.25  # others all 0: their plain mean
    assert leave_one_out_baseline([1.0, 0.0, 0.5], [1.0, 3.0, 1.0], 1) == 0.75


@pytest.mark.parametrize("aggregation", ["median", "winsorized_mean"])
def test_robust_aggregations_are_refused(aggregation):
    with pytest.raises(ValueError, match=f"opob_leave_one_out.*opob_aggregation='{aggregation}'"):
        vk.PolicyLossOptions(opob_aggregation=aggregation, **LOO)


def test_option_must_be_a_bool():
    with pytest.raises(ValueError, match="opob_leave_one_out must be a bool"):
        vk.PolicyLossOptions(opob_leave_one_out=1)
