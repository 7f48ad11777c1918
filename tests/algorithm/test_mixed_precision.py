"""vcpo.step in mixed precision (VCPOConfig.autocast, docs/grad_norms.md "Precision"): bf16 compute over fp32
parameters, the log-probs, exact per-sequence norms and loss in fp32, against the float64 step of the same weights
within bf16's accuracy; the parameters, gradients and optimizer state stay fp32; and autocast is really on (the
step differs from the fp32 one by more than fp32 rounding)."""

import copy

import pytest
import torch

import vcpo
from support.tiny_models import rollout_batch, tiny_llama

METRICS = ("loss", "grad_sq_norm_mean", "grad_norm", "lr_scale", "ess_ratio", "kl_k3")


def _step(model, batch, **options):
    before = [p.detach().double().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    metrics = vcpo.step(model, optimizer, batch, vcpo.VCPOConfig(grad_clip=None, backend="cpu", **options))
    update = torch.cat([(p.detach().double() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return metrics, update


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_bf16_mixed_step_matches_float64_to_bf16_accuracy(fused, tied, micro_batch_size):
    reference = tiny_llama(tied=tied)
    batch = rollout_batch(reference)
    batch.behavior_logp = batch.behavior_logp.float()
    options = dict(fused_lm_head=fused, micro_batch_size=micro_batch_size)
    fp32 = copy.deepcopy(reference).float()
    mixed = copy.deepcopy(fp32)
    want, want_update = _step(reference, batch, **options)
    got, update = _step(mixed, batch, autocast="bfloat16", **options)
    _, fp32_update = _step(fp32, batch, **options)
    for key in METRICS:
        assert got[key] == pytest.approx(want[key], rel=1e-2, abs=1e-6), key
    error = torch.linalg.vector_norm(update - want_update) / torch.linalg.vector_norm(want_update)
    assert error < 1e-2
    # autocast is on: fp32 is far closer to float64 than this (about 100x)
    assert torch.linalg.vector_norm(fp32_update - want_update) < 0.1 * torch.linalg.vector_norm(update - want_update)
    assert all(p.dtype == torch.float32 for p in mixed.parameters())


def test_bf16_mixed_keeps_fp32_gradients_and_adamw_state():
    model = tiny_llama().float()
    batch = rollout_batch(model)
    batch.behavior_logp = batch.behavior_logp.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = vcpo.step(model, optimizer, batch, vcpo.VCPOConfig(autocast="bfloat16", backend="cpu"))
    assert not metrics["skipped"]
    for p in model.parameters():
        state = optimizer.state[p]
        assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("value", ["bf16", torch.bfloat16, "float32", True])
def test_an_unknown_autocast_dtype_is_refused(value):
    with pytest.raises(ValueError, match=r"autocast must be one of \[None, 'bfloat16', 'float16'\]"):
        vcpo.VCPOConfig(autocast=value)
