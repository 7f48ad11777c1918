"""The compiled ops under torch.library.opcheck, torch.compile(fullgraph=True) and float64 gradcheck."""

import pytest
import torch

import vcpo
import vcpo_kernels as vk
from support.batches import random_batch
from support.backend_check import COMPILED_BACKENDS

pytestmark = pytest.mark.skipif(not COMPILED_BACKENDS, reason="the C++ extension is not built")


def _policy_loss_args(batch, *, clip=None, token=False):
    tokens = vk.inputs.token_batch(batch.logp, batch.behavior_logp, batch.old_logp, batch.mask, batch.cu_seqlens)
    dtype = tokens.acc_dtype
    opts = vk.PolicyLossOptions(is_level="token" if token else "sequence", clip_ratio=clip,
                                clip_ratio_c=1.5 if clip else None)
    return (
        tokens.logp.detach().clone().requires_grad_(), tokens.behavior_logp, tokens.old_logp, tokens.mask,
        tokens.cu_seqlens, batch.rewards.to(dtype), None, batch.group_index, batch.num_groups,
        batch.grad_sq_norm.to(dtype), *opts.packed(None),
    )


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("variant", ["bypass", "old-token-clip"])
def test_opcheck_policy_loss(layout, variant):
    batch = random_batch(1, layout, with_old=variant != "bypass")
    args = _policy_loss_args(batch, clip=(0.2, 0.2) if variant != "bypass" else None, token=variant != "bypass")
    torch.library.opcheck(torch.ops.vcpo.policy_loss.default, args)


def test_opcheck_standalone_ops():
    batch = random_batch(2, "packed")
    t = vk.inputs.token_batch(batch.logp, batch.behavior_logp, None, batch.mask, batch.cu_seqlens)
    torch.library.opcheck(torch.ops.vcpo.sequence_stats.default, (t.logp, t.behavior_logp, None, t.mask, t.cu_seqlens))
    s, length, _ = torch.ops.vcpo.sequence_stats(t.logp, t.behavior_logp, None, t.mask, t.cu_seqlens)
    torch.library.opcheck(torch.ops.vcpo.effective_sample_size.default, (s, length, 0.55, 1))
    args = (batch.rewards.float(), s, batch.grad_sq_norm.float(), batch.group_index, length, batch.num_groups, True,
            True)
    torch.library.opcheck(torch.ops.vcpo.opob_baseline.default, args)


@pytest.mark.slow  # a cold torch.compile: 10-25 s
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_torch_compile_fullgraph(backend):
    batch = random_batch(3, "padded", with_old=True)
    config = vcpo.VCPOConfig(backend=backend, clip_ratio=(0.2, 0.28))

    def step(logp, behavior_logp, old_logp, mask, rewards, group_index):
        out = vcpo.policy_loss(logp, behavior_logp, old_logp=old_logp, mask=mask, rewards=rewards,
                               group_index=group_index, num_groups=batch.num_groups, config=config)
        return out.loss, out.ess_ratio, out.lr_scale, out.advantages

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        logp = batch.logp.clone().requires_grad_()
        loss, *stats = fn(logp, batch.behavior_logp, batch.old_logp, batch.mask, batch.rewards, batch.group_index)
        loss.backward()
        results.append((loss, *stats, logp.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("options", [dict(), dict(is_level="token", clip_ratio=(0.2, 0.2), clip_ratio_c=2.0),
                                     dict(loss_agg_mode="token-mean", is_correction="mask", is_threshold=1.5)])
def test_gradcheck_float64(backend, options):
    """With a recomputed proximal policy the loss depends on logp through r, so finite differences apply."""
    batch = random_batch(4, "packed", num_seqs=5, max_len=6, dtype=torch.float64, with_old=True)
    logp = torch.where(batch.mask, batch.logp, 0).requires_grad_()

    def loss(lp):
        return vk.policy_loss(lp, batch.behavior_logp, old_logp=batch.old_logp, mask=batch.mask,
                              cu_seqlens=batch.cu_seqlens, rewards=batch.rewards, group_index=batch.group_index,
                              backend=backend, **options).loss

    assert torch.autograd.gradcheck(loss, (logp,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_upstream_gradient_scales_the_result(backend):
    batch = random_batch(5, "padded")
    grads = []
    for scale in (1.0, -2.5):
        logp = batch.logp.clone().requires_grad_()
        out = vk.policy_loss(logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                             group_index=batch.group_index, backend=backend)
        (scale * out.loss).backward()
        grads.append(logp.grad / scale)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0
