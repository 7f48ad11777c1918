"""The vcpo layer: config defaults, the loss module, ESS lr scaling, and the README example."""

import math
import re
from pathlib import Path

import pytest
import torch

import vcpo
import vcpo_kernels as vk
from support.batches import random_batch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_config_defaults_are_the_papers_but_the_lr_rule():
    c = vcpo.VCPOConfig()
    assert (c.is_level, c.is_correction, c.is_threshold) == ("sequence", "truncate", 8.0)
    assert c.threshold_low == 1 / 8
    assert (c.advantage, c.norm_by_std, c.opob_scope) == ("opob", True, "group")
    assert (c.lr_rule, c.ess_base_ratio, c.ess_on_corrected) == ("linear", 1.0, False)
    assert (c.clip_ratio, c.clip_ratio_c, c.loss_agg_mode) == (None, None, "seq-mean-token-mean")
    assert not (c.opob_length_norm or c.opob_truncated_weights or c.reference_compat)
    assert c.backend == "auto"


def test_module_and_function_agree():
    batch = random_batch(0, "padded")
    kw = dict(mask=batch.mask, rewards=batch.rewards, group_index=batch.group_index)
    module = vcpo.VCPOLoss(vcpo.VCPOConfig(is_threshold=2.0), advantage="grpo")
    assert module.config.is_threshold == 2.0 and module.config.advantage == "grpo"
    a = module(batch.logp, batch.behavior_logp, **kw)
    b = vcpo.policy_loss(batch.logp, batch.behavior_logp, config=module.config, **kw)
    c = vk.policy_loss(batch.logp, batch.behavior_logp, backend="torch", is_threshold=2.0, advantage="grpo", **kw)
    assert a.metrics() == b.metrics()
    for key, value in a.metrics().items():
        assert math.isclose(value, c.metrics()[key], rel_tol=1e-5, abs_tol=1e-6), key


@pytest.mark.parametrize("ratio,rule,base,want", [
    (0.25, "sqrt", 1.0, 0.5), (0.25, "linear", 1.0, 0.25), (0.25, None, 1.0, 1.0),
    (0.3, "sqrt", 0.55, math.sqrt(0.3 / 0.55)), (0.9, "sqrt", 0.55, 1.0), (0.0, "sqrt", 1.0, 0.0),
    (float("nan"), "sqrt", 1.0, 0.0), (float("nan"), None, 1.0, 0.0),
])
def test_ess_lr_scale(ratio, rule, base, want):
    assert vcpo.ess_lr_scale(ratio, rule, base) == pytest.approx(want)
    t = vcpo.ess_lr_scale(torch.tensor([ratio]), rule, base)
    assert isinstance(t, torch.Tensor) and t.item() == pytest.approx(want)


def _adamw_step(lr_scale, lr=0.1, wd=0.5):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd)
    p.grad = torch.randn(5)
    before = p.detach().clone()
    with vcpo.scale_lr(opt, lr_scale):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr * float(lr_scale))
        opt.step()
    assert opt.param_groups[0]["lr"] == lr
    return before, p.detach().clone()


def test_scale_lr_scales_the_step_and_the_weight_decay():
    before, after = _adamw_step(0.3)
    # Reference AdamW first step with lr * 0.3: decoupled decay, then an update of magnitude lr (m/sqrt(v) = sign).
    torch.manual_seed(0)
    p0 = torch.randn(5)
    g = torch.randn(5)
    lr = 0.1 * 0.3
    want = p0 * (1 - lr * 0.5) - lr * g / (g.abs() + 1e-8)
    torch.testing.assert_close(after, want)
    b0, a0 = _adamw_step(torch.tensor(0.0))
    torch.testing.assert_close(a0, b0, rtol=0, atol=0)


def test_scale_lr_restores_on_error_and_refuses_bad_scales():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    with pytest.raises(RuntimeError):
        with vcpo.scale_lr(opt, 0.1):
            raise RuntimeError("step failed")
    assert opt.param_groups[0]["lr"] == 0.5
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="lr_scale"):
            with vcpo.scale_lr(opt, bad):
                pass


def test_scale_lr_keeps_tensor_lrs_on_device():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    with vcpo.scale_lr(opt, torch.tensor(0.5)):
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        assert opt.param_groups[0]["lr"].item() == pytest.approx(0.005)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.01)


def test_readme_example_runs():
    """The README's Python example is executed as written, so the docs cannot drift from the code."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


@pytest.mark.parametrize("options", [dict(), dict(advantage="grpo"), dict(advantage="rloo"),
                                     dict(opob_scope="batch"), dict(reference_compat=True, is_threshold=1.5),
                                     dict(opob_length_norm=True, norm_by_std=False)])
def test_standalone_advantages_and_ess_are_the_losss(options):
    # vcpo_kernels.advantages and effective_sample_size(is_threshold=) from per-sequence data give what the
    # fused loss computes from the tokens (the data-parallel path relies on it).
    batch = random_batch(41, "packed", dtype=torch.float64)
    opts = vk.PolicyLossOptions(ess_on_corrected=True, **{"is_threshold": 1.1, **options})  # truncation bites
    out = vk.policy_loss(batch.logp, batch.behavior_logp, options=opts, backend="torch", **batch.kwargs())
    stats = vk.sequence_stats(batch.logp, batch.behavior_logp, cu_seqlens=batch.cu_seqlens, mask=batch.mask)
    got = vk.advantages(batch.rewards, stats.seq_log_weight, seq_length=stats.seq_length,
                        grad_sq_norm=batch.grad_sq_norm, group_index=batch.group_index, num_groups=batch.num_groups,
                        options=opts)
    torch.testing.assert_close(got.advantages, out.advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.baseline, out.baseline, rtol=1e-12, atol=1e-12)
    ess = vk.effective_sample_size(stats.seq_log_weight, seq_length=stats.seq_length, is_threshold=opts.is_threshold)
    torch.testing.assert_close(ess.ess_ratio, out.ess_ratio, rtol=1e-12, atol=1e-12)
