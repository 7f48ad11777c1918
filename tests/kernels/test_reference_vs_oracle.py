"""The reference backend (float64) against the naive oracle: values, statistics and hand-derived gradients."""

import math

import pytest
import torch

import vcpo_kernels as vk
from support.batches import random_batch
from support.cases import OPTION_CASES, case_runs
from support.oracle import oracle

CASES = [(name, old) for name in OPTION_CASES for old in case_runs(name)]


def _close(a, b, tol=1e-9):
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,with_old", CASES, ids=[f"{n}{'-old' if o else ''}" for n, o in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_oracle(name, with_old, layout, seed):
    opts = vk.PolicyLossOptions(**OPTION_CASES[name])
    batch = random_batch(seed, layout, dtype=torch.float64, with_old=with_old)
    logp = batch.logp.clone().requires_grad_()
    out = vk.policy_loss(logp, batch.behavior_logp, options=opts, backend="torch", **batch.kwargs())
    out.loss.backward()
    want = oracle(batch.oracle_seqs(), opts, batch.num_groups, opts.norm_length)

    assert _close(out.loss.item(), want["loss"])
    for key in ("ess", "ess_ratio", "lr_scale", "is_clip_fraction", "mean_is_coef", "kl_k3", "num_tokens",
                "num_seqs", "ppo_clip_fraction", "opob_max_share"):
        assert _close(getattr(out, key).item(), want[key]), key
    for key in ("baseline", "advantages", "seq_log_weight"):
        got = getattr(out, key).tolist()
        assert len(got) == len(want[key]), key
        assert all(_close(a, b) for a, b in zip(got, want[key])), (key, got, want[key])
    got_grads = batch.token_grads(logp.grad)
    assert all(_close(a, b) for g, w in zip(got_grads, want["grads"]) for a, b in zip(g, w))
    # Tokens that do not count get an exact zero gradient, even though they hold NaN.
    assert torch.all(logp.grad.reshape(-1)[~batch.counted()] == 0)


def test_reference_given_advantages_matches_oracle():
    batch = random_batch(3, "packed", dtype=torch.float64)
    adv = torch.randn(batch.rewards.shape, dtype=torch.float64)
    kw = batch.kwargs()
    kw.pop("rewards")
    logp = batch.logp.clone().requires_grad_()
    out = vk.policy_loss(logp, batch.behavior_logp, advantages=adv, backend="torch", **kw)
    out.loss.backward()
    want = oracle(batch.oracle_seqs(adv), vk.PolicyLossOptions(), batch.num_groups)
    assert _close(out.loss.item(), want["loss"])
    assert torch.all(out.baseline == 0)
    valid = torch.tensor([len(s) > 0 for s in want["grads"]])
    assert torch.equal(out.advantages, torch.where(valid, adv, 0))
