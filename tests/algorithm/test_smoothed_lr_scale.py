"""VCPOConfig.lr_scale_ema: each step taken at the bias-corrected moving average of the batch lr scales of the steps
taken so far (vcpo.smoothed_lr_scale), against a brute-force sum; its state saved and loaded with the optimizer's;
vcpo.step stepping at it (against a copy stepped at the batch scale with the lr set so that the products agree), a
skipped step leaving it as it was; and the TRL trainers' optimizer step taking it."""

import copy
import io
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import vcpo
from support.tiny_models import rollout_batch, tiny_llama


def brute_force(scales, beta):
    """(1 - beta) sum_j beta^(t-j) s_j / (1 - beta^t), summed term by term in float64."""
    t = len(scales)
    return sum((1 - beta) * beta ** (t - j) * s for j, s in enumerate(scales, 1)) / (1 - beta ** t)


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.99])
def test_the_moving_average_and_its_state_in_the_optimizers(beta):
    g = torch.Generator().manual_seed(int(beta * 100))
    scales = (torch.rand(30, generator=g, dtype=torch.float64) * 0.9 + 0.05).tolist()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    got = [vcpo.smoothed_lr_scale(opt, s, beta) for s in scales[:12]]
    assert got[0] == pytest.approx(scales[0], rel=1e-12)  # the first step's is its own scale
    # a checkpoint's optimizer state, through torch.save and weights_only loading, into a fresh optimizer
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    got += [vcpo.smoothed_lr_scale(fresh, s, beta) for s in scales[12:]]
    for t in range(1, len(scales) + 1):
        assert got[t - 1] == pytest.approx(brute_force(scales[:t], beta), rel=1e-12)
    assert max(got) < max(scales) and min(got) > min(scales)


@pytest.mark.parametrize("bad", [1.0, -0.1, math.nan, True, "0.9"])
def test_bad_betas_are_refused(bad):
    with pytest.raises(ValueError, match="lr_scale_ema must be a number in"):
        vcpo.VCPOConfig(lr_scale_ema=bad)


def test_the_step_takes_the_smoothed_scale_and_a_skipped_step_leaves_it():
    """Model A steps with lr_scale_ema = 0.6 over four batches (the third poisoned: skipped); model B, a copy, with
    the batch scale and its lr set to lr x (A's smoothed scale / the batch scale) before each step. Their weights
    agree after every step, and A's logged scales are the brute-force average of its batch scales."""
    beta, lr = 0.6, 1e-2
    a = tiny_llama(seed=3)
    b = copy.deepcopy(a)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=lr), torch.optim.SGD(b.parameters(), lr=lr)
    smooth, plain = vcpo.VCPOConfig(lr_scale_ema=beta), vcpo.VCPOConfig()
    taken = []
    for seed in (1, 2, 3, 4):
        batch = rollout_batch(a, seed=seed)
        if seed == 3:
            batch.behavior_logp[0, int(batch.loss_mask[0].nonzero()[1])] = -math.inf
        before = copy.deepcopy(opt_a.param_groups[0].get("vcpo_lr_scale_ema"))
        m = vcpo.step(a, opt_a, batch, smooth)
        if seed == 3:
            assert m["skipped"] == 1.0 and opt_a.param_groups[0].get("vcpo_lr_scale_ema") == before
            continue
        taken.append(m["batch_lr_scale"])
        assert m["lr_scale"] == pytest.approx(brute_force(taken, beta), rel=1e-12)
        opt_b.param_groups[0]["lr"] = lr * m["lr_scale"] / m["batch_lr_scale"]
        mb = vcpo.step(b, opt_b, batch, plain)
        assert mb["lr_scale"] == mb["batch_lr_scale"] == pytest.approx(m["batch_lr_scale"], rel=1e-12)
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-10, atol=1e-12, msg=name)
    assert len(set(taken)) == 3 and m["lr_scale"] != pytest.approx(m["batch_lr_scale"], rel=1e-3)


def test_the_trl_trainers_optimizer_step_takes_the_smoothed_scale():
    pytest.importorskip("trl")
    from vcpo.integrations.trl import _OptimizerStep

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    step = _OptimizerStep(defaultdict(list), lr_scale_ema=0.5)
    seen, scales = [], [0.4, 0.8, 0.3]
    for i, scale in enumerate(scales):
        step.begin(opt, SimpleNamespace(global_step=i), scale, scale ** 2, 1.0)
        seen.append(opt.param_groups[0]["lr"])
        step.end()
        assert opt.param_groups[0]["lr"] == 0.1
    assert seen == pytest.approx([0.1 * brute_force(scales[:t], 0.5) for t in (1, 2, 3)], rel=1e-12)
