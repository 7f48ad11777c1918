"""Properties the contract implies, on fresh random inputs, for every backend."""

import pytest
import torch

import vcpo_kernels as vk
from support.batches import random_batch
from support.backend_check import COMPILED_BACKENDS

ALL_BACKENDS = ["torch"] + COMPILED_BACKENDS


def _stats(backend, batch, rewards=None, **opts):
    return vk.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, cu_seqlens=batch.cu_seqlens,
                          rewards=batch.rewards if rewards is None else rewards, group_index=batch.group_index,
                          num_groups=batch.num_groups, grad_sq_norm=batch.grad_sq_norm, backend=backend, **opts)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_reward_shift_leaves_opob_advantages_unchanged(backend, seed, norm_by_std):
    batch = random_batch(seed, "packed", dtype=torch.float64, spread=1.0)
    shift = torch.randn(batch.num_groups, dtype=torch.float64) * 5
    a = _stats(backend, batch, norm_by_std=norm_by_std)
    b = _stats(backend, batch, rewards=batch.rewards + shift[batch.group_index], norm_by_std=norm_by_std)
    torch.testing.assert_close(a.advantages, b.advantages, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(a.baseline + shift, b.baseline, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_baseline_within_group_reward_range_and_ess_bounds(backend, seed):
    batch = random_batch(seed, "padded", num_seqs=16, spread=2.0)
    batch.rewards = torch.randn(16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = _stats(backend, batch)
    valid = out.seq_log_weight.new_tensor([m.any() for m in batch.mask], dtype=torch.bool)
    for g in range(batch.num_groups):
        members = (batch.group_index == g) & valid
        if members.any():
            r = batch.rewards[members]
            assert r.min() - 1e-6 <= out.baseline[g].double() <= r.max() + 1e-6
    n = out.num_seqs.item()
    assert 1 / n - 1e-6 <= out.ess_ratio.item() <= 1 + 1e-6


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_on_policy_batch_has_full_ess(backend):
    batch = random_batch(2, "packed")
    out = vk.policy_loss(batch.logp, batch.logp.clone(), mask=batch.mask, cu_seqlens=batch.cu_seqlens,
                         rewards=batch.rewards, group_index=batch.group_index, backend=backend)
    assert out.ess.item() == pytest.approx(out.num_seqs.item(), rel=1e-6)
    assert out.lr_scale.item() == pytest.approx(1.0, rel=1e-6)
    assert out.kl_k3.item() == 0 and out.is_clip_fraction.item() == 0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_opob_with_unit_weights_is_the_group_mean(backend):
    """w = 1 and G = 1: the optimal baseline reduces to the classic group mean."""
    batch = random_batch(6, "padded", dtype=torch.float64)
    out = vk.policy_loss(batch.logp, batch.logp.clone(), mask=batch.mask, rewards=batch.rewards,
                         group_index=batch.group_index, backend=backend)
    grpo = vk.policy_loss(batch.logp, batch.logp.clone(), mask=batch.mask, rewards=batch.rewards,
                          group_index=batch.group_index, backend=backend, advantage="grpo")
    torch.testing.assert_close(out.baseline, grpo.baseline, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_heavier_weight_pulls_the_baseline(backend):
    """One group, two sequences: b moves toward the reward of the sequence with the larger w^2 G."""
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mu = torch.tensor([[0.0, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)  # w = (1, e^0.5)
    out = vk.opob_baseline(torch.tensor([0.0, 1.0], dtype=torch.float64),
                           vk.sequence_stats(logp, mu, backend=backend).seq_log_weight, backend=backend)
    w2 = torch.tensor([1.0, torch.e], dtype=torch.float64)
    assert out.baseline.item() == pytest.approx((w2[1] / w2.sum()).item(), rel=1e-12)
