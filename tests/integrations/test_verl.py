"""vcpo.integrations.verl against the real verl 0.9.1 on the CPU: the `vcpo` loss looked up in verl's registry and
called through verl's own `ppo_loss` (TensorDict, no-padding log-probs, global batch counts) against the float64
oracle; against verl's own losses where the math coincides (`vanilla` with token-level IS weights, `vanilla` with
verl's decoupled sequence IS weights, `bypass_mode` REINFORCE); the plugin found by `import verl` in a fresh
process; VCPOAdamW's lr scale over micro-batches and over two gloo ranks against the float64 ESS."""

import copy
import math
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")  # installed with --no-deps (docs/integrations.md)
from tensordict import TensorDict  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import vcpo_kernels  # noqa: E402
from support.oracle import Seq, oracle  # noqa: E402
from support.ranks import on_ranks  # noqa: E402
from vcpo.integrations import verl as vv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
P, R = 2, 5  # prompt and response widths of the padded batch


def actor_config(loss_mode="vcpo", mode="token-mean", rollout_is="sequence", threshold=8.0, **kw):
    rc = RolloutCorrectionConfig(rollout_is=rollout_is, rollout_is_threshold=threshold,
                                 **{k: kw.pop(k) for k in list(kw) if k.startswith("rollout_") or k == "loss_type"})
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                           loss_agg_mode=mode, policy_loss=PolicyLossConfig(loss_mode=loss_mode, rollout_correction=rc),
                           **kw)


def batch(seed, b=6, spread=0.4):
    """Response mask with a fully masked row, behaviour log-probs, current log-probs, one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (b,), generator=g)
    lengths[1] = 0
    mask = torch.arange(R)[None] < lengths[:, None]
    mu = -torch.rand(b, R, generator=g, dtype=torch.float64) - 0.1
    lp = mu + spread * torch.randn(b, R, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return mask, mu, lp, adv


def through_ppo_loss(config, mask, mu, lp, adv, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """verl's ppo_loss on one micro-batch: the model's log-probs in verl's no-padding layout (prompt then response
    per row, each response token's log-prob one position before it), the rest in a TensorDict. Returns the loss
    and the gradient on the response log-probs [b, R]."""
    b = mask.shape[0]
    attention = torch.cat([torch.ones(b, P, dtype=torch.long), mask.long()], 1)
    rows = [torch.cat([torch.zeros(P - 1, dtype=lp.dtype), lp[i, :int(mask[i].sum())], lp.new_zeros(1)])
            for i in range(b)]
    flat = torch.cat(rows).requires_grad_()
    data = TensorDict({"prompts": torch.zeros(b, P, dtype=torch.long), "responses": torch.zeros(b, R, dtype=torch.long),
                       "attention_mask": attention, "response_mask": mask.long(), "old_log_probs": mu,
                       "advantages": adv[:, None] * mask}, batch_size=b)
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    loss, _ = ppo_loss(config, {"log_probs": flat}, data)
    loss.backward()
    grads, start = torch.zeros_like(lp), 0
    for i, row in enumerate(rows):
        n = int(mask[i].sum())
        grads[i, :n] = flat.grad[start + P - 1:start + P - 1 + n]
        assert not flat.grad[start:start + P - 1].any() and flat.grad[start + P - 1 + n] == 0
        start += len(row)
    return loss.detach(), grads


def seqs_of(mask, mu, lp, adv):
    return [Seq(lp=lp[i][mask[i]].tolist(), mu=mu[i][mask[i]].tolist(), old=None, reward=0.0, group=0, grad_sq=1.0,
                advantage=float(adv[i])) for i in range(mask.shape[0])]


def oracle_of(mask, mu, lp, adv, **options):
    o = vcpo_kernels.PolicyLossOptions(**options)
    return oracle(seqs_of(mask, mu, lp, adv), o, num_groups=1, norm_length=R)


def test_registered_in_verls_registry():
    assert core_algos.get_policy_loss_fn("vcpo") is vv.vcpo_policy_loss
    for verl_rule, loss in vv.TRUST_REGION_LOSSES.items():
        assert core_algos.get_policy_loss_fn(f"vcpo_{verl_rule}") is loss


VERL_RULE_FIELDS = {  # verl's actor fields of each rule, chosen so that the rule acts on some tokens of batch(9)
    "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.25, clip_ratio_c=1.5),
    "gspo": dict(clip_ratio_low=0.05, clip_ratio_high=0.08),
    "geo_mean": dict(clip_ratio_low=0.1, clip_ratio_high=0.15),
    "cispo": dict(clip_ratio_low=10.0, clip_ratio_high=0.2),
    "dppo_tv": dict(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.5),
    "sapo": dict(tau_pos=0.8, tau_neg=1.3),
}


@pytest.mark.parametrize("verl_rule", list(VERL_RULE_FIELDS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_trust_region_modes_equal_verls_own_losses(verl_rule, mode):
    """loss_mode vcpo_<rule> through verl's ppo_loss (global counts, bypass: old_log_prob = mu, no rollout IS) is
    verl's own <rule> with the same actor fields: the loss and the gradient (verl's geo_mean divides by all rows and
    sapo forces seq-mean-token-mean: compared where they agree, docs/contract.md, "Trust regions")."""
    if (verl_rule, mode) in (("geo_mean", "token-mean"), ("sapo", "token-mean")):
        pytest.skip("verl ignores loss_agg_mode for this rule")
    mask, mu, lp, adv = batch(9, spread=0.5)
    keep = mask.any(1)  # geo_mean divides by every row: no fully masked one
    mask, mu, lp, adv = mask[keep], mu[keep], lp[keep], adv[keep]
    fields = VERL_RULE_FIELDS[verl_rule]
    counts = dict(batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    theirs = actor_config(loss_mode=verl_rule, mode=mode, rollout_is=None, **fields)
    ours = actor_config(loss_mode=f"vcpo_{verl_rule}", mode=mode, rollout_is=None, **fields)
    want, want_grad = through_ppo_loss(theirs, mask, mu, lp, adv, **counts)
    got, got_grad = through_ppo_loss(ours, mask, mu, lp, adv, **counts)
    tol = dict(rtol=1e-7, atol=1e-12) if mode == "seq-mean-token-mean" or verl_rule == "geo_mean" else \
        dict(rtol=1e-10, atol=1e-13)  # verl divides by L_i + 1e-8
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_grad, want_grad, **tol)
    out = vcpo_kernels.policy_loss(lp, mu, mask=mask, advantages=adv, options=vv.loss_options(ours, mode, verl_rule))
    assert verl_rule == "sapo" or 0 < float(out.ppo_clip_fraction) < 1  # the rule acted on some tokens, not all
    vv._SUMS.clear()


def test_trust_region_modes_refuse_rollout_is():
    mask, mu, lp, adv = batch(6)
    with pytest.raises(ValueError, match="rollout_is=null"):
        vv.TRUST_REGION_LOSSES["gspo"](mu, lp, adv[:, None] * mask, mask, "token-mean",
                                       actor_config(loss_mode="vcpo_gspo", rollout_is="sequence"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level,threshold", [("sequence", 1.5), ("token", 1.2), (None, 8.0)])
def test_ppo_loss_micro_batches_over_two_ranks_equal_the_float64_oracle(mode, level, threshold):
    """Six sequences (one fully masked) as 2 ranks x 2 micro-batches through verl's ppo_loss with its global counts:
    the ranks' averaged gradient is the whole batch's, the ranks' mean loss the whole loss, and VCPOAdamW's scale
    from the four calls the whole batch's ESS lr scale."""
    mask, mu, lp, adv = batch(1)
    config = actor_config(mode=mode, rollout_is=level, threshold=threshold)
    want = oracle_of(mask, mu, lp, adv, is_level=level or "sequence", is_correction="truncate" if level else "none",
                     is_threshold=threshold, loss_agg_mode=mode)
    counts = dict(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    opt = vv.VCPOAdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    opt.zero_grad()
    total, grads = 0.0, []
    for rows in ([0, 1], [2], [3, 4], [5]):  # rank 0: rows 0-2, rank 1: rows 3-5
        loss, g = through_ppo_loss(config, mask[rows], mu[rows], lp[rows], adv[rows], **counts)
        total += float(loss) / 2
        grads.append(g / 2)
    # verl's sequence count is the mini-batch's rows (6), the oracle's B' its valid sequences (5)
    f = 1.0 if mode == "token-mean" else want["num_seqs"] / mask.shape[0]
    assert math.isclose(total, f * want["loss"], rel_tol=1e-12, abs_tol=1e-12)
    grads = torch.cat(grads)
    for i in range(mask.shape[0]):
        torch.testing.assert_close(grads[i][mask[i]], f * torch.tensor(want["grads"][i], dtype=torch.float64),
                                   rtol=1e-12, atol=1e-14)
    scale = opt.lr_scale()
    assert 0 < want["lr_scale"] < 1
    assert math.isclose(scale, want["lr_scale"], rel_tol=1e-12)
    assert math.isclose(opt.vcpo_stats["ess"], want["ess"], rel_tol=1e-12) and opt.vcpo_stats["num_seqs"] == 5


@pytest.mark.parametrize("mode", MODES)
def test_token_level_equals_verls_vanilla_with_the_behaviour_as_old_policy(mode):
    """VCPO with token-level weights and no truncation in reach is verl's vanilla PPO loss with old_log_prob = the
    behaviour policy and its clipping out of reach: both are -A pi/mu per token, with the same gradient."""
    mask, mu, lp, adv = batch(2, spread=0.1)
    counts = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    ours = through_ppo_loss(actor_config(mode=mode, rollout_is="token", threshold=1e6), mask, mu, lp, adv, **counts)
    far = dict(clip_ratio=1e6, clip_ratio_low=1e6, clip_ratio_high=1e6, clip_ratio_c=1e6)
    theirs = through_ppo_loss(actor_config("vanilla", mode, **far), mask, mu, lp, adv, **counts)
    tol = dict(rtol=1e-7, atol=1e-12) if mode == "seq-mean-token-mean" else dict(rtol=1e-12, atol=1e-14)  # verl: L+1e-8
    torch.testing.assert_close(ours[0], theirs[0], **tol)
    torch.testing.assert_close(ours[1], theirs[1], **tol)


@pytest.mark.parametrize("level,threshold", [("sequence", 1.5), ("token", 1.1)])
def test_equals_verls_is_weighted_losses(level, threshold):
    """verl's own truncated IS weights (rollout_corr_helper) on the current policy, in decoupled mode's vanilla loss
    (old_log_prob = current policy, so the PPO ratio is 1): the same loss and gradient as VCPO's. And verl's
    bypass-mode REINFORCE with the same rollout_correction: the same gradient (its loss value is -A w log pi)."""
    mask, mu, lp, adv = batch(3)
    lp, mu, m, a = lp.float(), mu.float(), mask, (adv[:, None] * mask).float()
    config = actor_config(mode="token-mean", rollout_is=level, threshold=threshold)
    x = lp.clone().requires_grad_()
    loss, _ = vv.vcpo_policy_loss(mu, x, a, m, "token-mean", config)
    (grad,) = torch.autograd.grad(loss, x)

    weights, _, _ = compute_rollout_correction_and_rejection_mask(lp, mu, m, rollout_is=level,
                                                                  rollout_is_threshold=threshold)
    w = weights.batch["rollout_is_weights"]
    assert ((w > 0) & (w < threshold) & m).any() and (w == threshold).any()  # some truncated, some not
    y = lp.clone().requires_grad_()
    vanilla, _ = core_algos.get_policy_loss_fn("vanilla")(y.detach(), y, a, m, "token-mean",
                                                          actor_config("vanilla", clip_ratio_c=3.0), w)
    torch.testing.assert_close(loss, vanilla, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, torch.autograd.grad(vanilla, y)[0], rtol=1e-6, atol=1e-7)

    z = lp.clone().requires_grad_()
    reinforce, _ = core_algos.get_policy_loss_fn("bypass_mode")(
        mu, z, a, m, "token-mean", actor_config("bypass_mode", rollout_is=level, threshold=threshold,
                                                 loss_type="reinforce"))
    torch.testing.assert_close(grad, torch.autograd.grad(reinforce, z)[0], rtol=1e-6, atol=1e-7)


RS = [("token_k1", "0.8_1.1"), ("token_k2,token_k3", "0.03,0.04"), ("seq_sum_k1", "1.3"), ("seq_mean_k2", "0.05"),
      ("seq_max_k3,seq_sum_k3,seq_mean_k1", "0.1,0.2,0.8_1.3")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rs,rs_threshold", RS + [(None, None)])
@pytest.mark.parametrize("level,threshold,normalize", [("sequence", 1.5, True), ("token", 1.2, True),
                                                       ("token", 1.3, False)])
def test_rejection_and_batch_normalisation_equal_verls_bypass_reinforce(mode, rs, rs_threshold, level, threshold,
                                                                        normalize):
    """verl's rollout_rs criteria and rollout_is_batch_normalize, mapped: through verl's ppo_loss with its global
    counts, the gradient of the `vcpo` loss is the one of verl's bypass-mode REINFORCE with the same
    rollout_correction (-A w per kept token; its loss value is -A w log pi)."""
    if rs is not None and mode == "seq-mean-token-mean" and "token_" in rs:
        pytest.skip("refused: verl divides each sequence by its kept tokens (test_refuses_what_vcpo_cannot_reproduce)")
    mask, mu, lp, adv = batch(7, b=8, spread=0.3)
    counts = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    kw = dict(rollout_is=level, threshold=threshold, rollout_is_batch_normalize=normalize, rollout_rs=rs,
              rollout_rs_threshold=rs_threshold)
    ours = through_ppo_loss(actor_config("vcpo", mode, **kw), mask, mu, lp, adv, **counts)
    theirs = through_ppo_loss(actor_config("bypass_mode", mode, loss_type="reinforce", **kw), mask, mu, lp, adv,
                              **counts)
    _, kept, _ = compute_rollout_correction_and_rejection_mask(lp, mu, mask, rollout_is=level,
                                                               rollout_is_threshold=threshold, rollout_rs=rs,
                                                               rollout_rs_threshold=rs_threshold)
    if rs is not None:
        assert 0 < kept.sum() < mask.sum()  # something rejected, something kept
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)  # seen: 3e-16 of the largest


def switch_overrides():
    """The command-line overrides docs/integrations.md gives as verl's switch (its verl section's bash block), as
    the shell splits them."""
    text = (ROOT / "docs" / "integrations.md").read_text().split("\n## verl", 1)[1]
    words = shlex.split(text.split("```bash\n", 1)[1].split("```", 1)[0])
    return [w for w in words if w.lstrip("+").startswith(("algorithm.", "actor_rollout_ref."))]


def test_the_documented_switch_composes_in_verls_own_config():
    """verl's ppo_trainer.yaml composed by Hydra with the documented overrides (plus the batch sizes any run sets):
    the actor config verl builds from it runs the vcpo loss with C and the aggregation given there, and its optim
    config builds VCPOAdamW through verl's build_optimizer."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    overrides = switch_overrides()
    assert len(overrides) == 9 and any(o.endswith("override_optimizer_config={lr_rule:linear,ess_base_ratio:1.0}")
                                       for o in overrides)
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides + [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=4"])
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.actor_rollout_ref.rollout.calculate_log_probs
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    options = vv.loss_options(actor, actor.loss_agg_mode)
    assert (options.is_level, options.is_correction, options.is_threshold, options.loss_agg_mode) == (
        "sequence", "truncate", 8.0, "seq-mean-token-mean")
    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim)
    assert type(opt) is vv.VCPOAdamW and opt.lr_rule == "linear" and opt.ess_base_ratio == 1.0


def test_verl_builds_the_optimizer_from_its_config():
    """actor.optim as a user writes it, through verl's own build_optimizer (the FSDP engines' path)."""
    config = FSDPOptimizerConfig(optimizer="VCPOAdamW", optimizer_impl="vcpo.integrations.verl", lr=0.1,
                                 weight_decay=0.01, override_optimizer_config={"lr_rule": "sqrt",
                                                                              "ess_base_ratio": 0.5})
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], config)
    assert type(opt) is vv.VCPOAdamW and (opt.lr_rule, opt.ess_base_ratio) == ("sqrt", 0.5)
    assert opt.defaults["lr"] == 0.1 and opt.defaults["weight_decay"] == 0.01 and opt.defaults["betas"] == (0.9, 0.999)


def test_optimizer_step_runs_at_the_scaled_lr_and_restores_it():
    mask, mu, lp, adv = batch(4)
    p = torch.nn.Parameter(torch.ones(3))
    ref = torch.nn.Parameter(torch.ones(3))
    opt, plain = vv.VCPOAdamW([p], lr=0.1, weight_decay=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1)
    opt.zero_grad()
    vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", actor_config(threshold=2.0))
    want = oracle_of(mask, mu, lp, adv, is_threshold=2.0)["lr_scale"]
    p.grad = ref.grad = torch.tensor([1.0, -2.0, 0.5])
    plain.param_groups[0]["lr"] = 0.1 * want
    opt.step()
    plain.step()
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["lr"] == 0.1 and math.isclose(opt.vcpo_stats["lr_scale"], want, rel_tol=1e-12)
    opt.zero_grad()  # a new mini-batch: no loss call, so stepping is an error (the loss mode is not vcpo)
    with pytest.raises(RuntimeError, match="loss_mode=vcpo"):
        opt.step()


def test_lr_scale_ema_steps_at_the_moving_average_of_the_mini_batches_scales():
    """Three mini-batches with lr_scale_ema = 0.5: each step's lr is lr x the bias-corrected average of the float64
    oracle's lr scales so far (the first its own; against AdamW at that lr), `.vcpo_stats` has both, and the lr is
    restored after."""
    p, ref = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt, plain = vv.VCPOAdamW([p], lr=0.1, lr_scale_ema=0.5), torch.optim.AdamW([ref], lr=0.1)
    wanted = []
    for seed in (4, 5, 6):
        mask, mu, lp, adv = batch(seed, spread=0.8)
        opt.zero_grad()
        vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", actor_config(threshold=2.0))
        wanted.append(oracle_of(mask, mu, lp, adv, is_threshold=2.0)["lr_scale"])
        t = len(wanted)
        average = sum(0.5 * 0.5 ** (t - j) * s for j, s in enumerate(wanted, 1)) / (1 - 0.5 ** t)
        p.grad = ref.grad = torch.tensor([1.0, -2.0, 0.5]) * seed
        plain.param_groups[0]["lr"] = 0.1 * average
        opt.step()
        plain.step()
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
        assert math.isclose(opt.vcpo_stats["lr_scale"], average, rel_tol=1e-12)
        assert math.isclose(opt.vcpo_stats["batch_lr_scale"], wanted[-1], rel_tol=1e-12)
        assert opt.param_groups[0]["lr"] == 0.1
    assert len(set(wanted)) == 3 and not math.isclose(average, wanted[-1], rel_tol=1e-3)
    with pytest.raises(ValueError, match="lr_scale_ema"):
        vv.VCPOAdamW([torch.nn.Parameter(torch.ones(1))], lr=0.1, lr_scale_ema=1.0)


@pytest.mark.parametrize("bad, grad, reason", [
    (-math.inf, "finite", "lr_scale"),  # s_i = +inf: a finite loss and gradient, but a NaN ESS (lr scale 0)
    (None, "nan", "grad_norm"),  # a NaN gradient (verl's actor skips it before calling step; used alone, VCPOAdamW)
])
def test_a_nonfinite_step_is_skipped_whole(bad, grad, reason):
    """A step at lr scale 0 would still move AdamW's moments and step count; a NaN gradient would write NaN: such a
    step is skipped, as vcpo.step skips one (weights and state bitwise as they were, gradients cleared)."""
    mask, mu, lp, adv = batch(4)
    p = torch.nn.Parameter(torch.ones(3))
    opt = vv.VCPOAdamW([p], lr=0.1, weight_decay=0.1)
    opt.zero_grad()
    vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", actor_config(threshold=2.0))
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()  # a finite step: AdamW has state now
    assert opt.vcpo_stats["skipped"] == 0.0
    before, state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    if bad is not None:
        mu = mu.clone()
        mu[0, 0] = bad
    vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", actor_config(threshold=2.0))
    p.grad = torch.tensor([1.0, math.nan if grad == "nan" else -2.0, 0.5])
    with pytest.warns(UserWarning, match=f"step skipped, not finite: {reason}"):
        opt.step()
    assert torch.equal(p.detach(), before) and p.grad is None
    after = opt.state_dict()["state"][0]
    assert after.keys() == state["state"][0].keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(after[k], state["state"][0][k]) for k in after)  # moments and step count
    assert opt.vcpo_stats["skipped"] == 1.0 and opt.vcpo_stats["skip_reason"] in (2.0, 4.0)
    assert opt.param_groups[0]["lr"] == 0.1


def test_ess_sums_in_log_space_and_degenerate_weights():
    """_log_sums/_merge over micro-batches against vcpo_kernels.effective_sample_size (float64, torch) on the
    concatenation: log weights of +-1e4, a micro-batch of zero weights, an empty one; all weights zero or a NaN
    weight: NaN ESS, lr scale 0."""
    s = torch.tensor([1e4, 1e4 - 1.0, -1e4, 3.0, -math.inf, 0.5], dtype=torch.float64)
    valid = torch.tensor([True, True, True, True, True, False])
    parts = [(s[:2], valid[:2]), (s[2:2], valid[2:2]), (s[4:5], valid[4:5]), (s[2:4], valid[2:4]), (s[5:], valid[5:])]
    merged = vv._merge(torch.stack([vv._log_sums(x, v) for x, v in parts]))
    want = vcpo_kernels.effective_sample_size(s, seq_length=valid.double(), backend="torch")
    _, s1, s2, n, calls = merged.tolist()
    assert n == 5 and calls == 5
    assert math.isclose(s1 * s1 / s2, float(want.ess), rel_tol=1e-12)
    opt = vv.VCPOAdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for bad in (torch.tensor([-math.inf, -math.inf]), torch.tensor([0.0, math.nan])):
        vv._SUMS[:] = [vv._log_sums(bad, torch.ones(2, dtype=torch.bool))]
        assert opt.lr_scale() == 0.0 and math.isnan(opt.vcpo_stats["ess_ratio"])
    vv._SUMS[:] = [vv._log_sums(torch.zeros(2), torch.zeros(2, dtype=torch.bool))]  # no valid sequence
    assert opt.lr_scale() == 0.0 and opt.vcpo_stats["num_seqs"] == 0
    vv._SUMS.clear()


def _lr_stats_on_rank(rank, same):
    mask, mu, lp, adv = batch(5, b=7, spread=0.6)
    if same:  # peers holding the same sequences (tensor or sequence parallel), cut into other micro-batches
        micro = [[0, 1, 2, 3], [4, 5, 6]] if rank == 0 else [[0], [1, 2], [3, 4, 5, 6]]
    else:  # data parallel: different sequences, micro-batch counts and sizes
        micro = [[0, 1, 2], [3]] if rank == 0 else [[4, 5, 6]]
    config = actor_config(threshold=4.0)
    info = dict(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=7)
    config.global_batch_info.update(info)
    opt = vv.VCPOAdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0, lr_rule="linear", ess_base_ratio=0.9)
    opt.zero_grad()
    for rows in micro:
        core_algos.get_policy_loss_fn("vcpo")(mu[rows], lp[rows], (adv[:, None] * mask)[rows], mask[rows],
                                              "token-mean", config)
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    return opt.vcpo_stats


def _nan_gradient_on_rank_1(rank):
    """Rank 1's gradient has a NaN (a shard of FSDP, say), rank 0's is finite: both skip (the gathered maximum)."""
    mask, mu, lp, adv = batch(5, b=7, spread=0.6)
    config = actor_config(threshold=4.0)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=7)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = vv.VCPOAdamW([p], lr=1.0)
    opt.zero_grad()
    rows = [0, 1, 2, 3] if rank == 0 else [4, 5, 6]
    core_algos.get_policy_loss_fn("vcpo")(mu[rows], lp[rows], (adv[:, None] * mask)[rows], mask[rows], "token-mean",
                                          config)
    p.grad = torch.tensor([1.0, math.nan if rank == 1 else 2.0])
    opt.step()
    return {**opt.vcpo_stats, "weights": p.detach().clone()}


def _on_rank(rank):
    return {**{same: _lr_stats_on_rank(rank, same) for same in (False, True)}, "nan": _nan_gradient_on_rank_1(rank)}


@pytest.fixture(scope="module")
def two_ranks():
    """VCPOAdamW's statistics on two gloo ranks, for both layouts (one launch)."""
    return on_ranks(_on_rank)


@pytest.mark.slow
@pytest.mark.parametrize("same", [False, True], ids=["data-parallel", "same-sequences"])
def test_two_gloo_ranks_take_the_same_lr_scale(two_ranks, same):
    """Both ranks get the same bits, the float64 lr scale of the 6 valid sequences; ranks that hold the same
    sequences count each twice, which leaves the ratio (and the scale) that of the sequences once."""
    r0, r1 = (r[same] for r in two_ranks)
    assert r0 == r1
    mask, mu, lp, adv = batch(5, b=7, spread=0.6)
    want = oracle_of(mask, mu, lp, adv, is_threshold=4.0, lr_rule="linear", ess_base_ratio=0.9)
    assert 0 < want["lr_scale"] < 1 and r0["num_seqs"] == 6 * (2 if same else 1)
    assert math.isclose(r0["lr_scale"], want["lr_scale"], rel_tol=1e-12)


@pytest.mark.slow
def test_a_nan_gradient_on_one_rank_skips_the_step_on_both(two_ranks):
    r0, r1 = (r["nan"] for r in two_ranks)
    assert r0["skipped"] == r1["skipped"] == 1.0 and r0["skip_reason"] == r1["skip_reason"] == 2.0
    assert torch.equal(r0["weights"], torch.zeros(2)) and torch.equal(r1["weights"], torch.zeros(2))


@pytest.mark.parametrize("change,match", [
    (dict(threshold="0.5_2.0"), "single rollout_correction.rollout_is_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", mode="seq-mean-token-mean"),
     "token-level rollout_correction.rollout_rs"),
    (dict(rollout_rs="seq_sum_k2"), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold="2.0"), "rejection criterion"),
    (dict(rollout_is="geometric"), "rollout_is must be"),
    (dict(mode="token-sum"), "loss_agg_mode"),
])
def test_refuses_what_vcpo_cannot_reproduce(change, match):
    mask, mu, lp, adv = batch(6)
    with pytest.raises(ValueError, match=match):
        vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, change.get("mode", "token-mean"), actor_config(**change))


def test_refuses_decoupled_weights_and_missing_counts():
    mask, mu, lp, adv = batch(6)
    with pytest.raises(ValueError, match="bypass_mode=True"):
        vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", actor_config(), torch.ones_like(lp))
    config = actor_config()
    config.global_batch_info.update(dp_size=2)
    with pytest.raises(ValueError, match="global batch counts"):
        vv.vcpo_policy_loss(mu, lp, adv[:, None] * mask, mask, "token-mean", config)
    with pytest.raises(ValueError, match="lr_rule"):
        vv.VCPOAdamW([torch.nn.Parameter(torch.zeros(1))], lr_rule="cube")
    vv._SUMS.clear()


@pytest.mark.slow
def test_import_verl_loads_the_plugin_in_a_fresh_process(tmp_path):
    """The entry point pyproject.toml declares, installed as package metadata: `import verl` alone registers the
    loss (and, with verl's VERL_USE_EXTERNAL_PLUGINS=none, it does not); `import vcpo` imports no verl."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")  # tomli: Python 3.10
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    assert entry == {"vcpo": "vcpo.integrations.verl"}
    info = tmp_path / "vcpo_entry-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vcpo-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    code = textwrap.dedent("""
        import sys, vcpo
        assert "verl" not in sys.modules
        import verl
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
        print("vcpo" in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY["vcpo"].__module__)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert on.stdout.split()[-1] == "vcpo.integrations.verl"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(env, VERL_USE_EXTERNAL_PLUGINS="none"))
    assert off.stdout.split()[-1] == "False"
