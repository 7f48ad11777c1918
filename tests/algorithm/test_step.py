"""vcpo.step on a tiny Hugging Face model against an update assembled by hand from a per-sequence backward
loop, the float64 reference loss and a plain optimizer step at the ESS-scaled learning rate."""

import copy

import pytest
import torch

import vcpo
import vcpo_kernels as vk
from vcpo.step import token_logp

transformers = pytest.importorskip("transformers")
from support.tiny_models import rollout_batch, tiny_llama  # noqa: E402


def _reference_update(model, optimizer, batch, config):
    params = [p for p in model.parameters()]
    mask = batch.loss_mask[:, 1:] != 0
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logp(logits[:, :-1], batch.input_ids[:, 1:])
    g_sq = []
    for i in range(logp.shape[0]):  # one backward per sequence
        grads = torch.autograd.grad((logp[i] * mask[i]).sum(), params, retain_graph=True)
        g_sq.append(sum(g.pow(2).sum() for g in grads))
    leaf = logp.detach().requires_grad_()
    out = vk.policy_loss(leaf, batch.behavior_logp[:, 1:], mask=mask,
                         old_logp=None if batch.old_logp is None else batch.old_logp[:, 1:],
                         rewards=batch.rewards, group_index=batch.group_index, grad_sq_norm=torch.stack(g_sq),
                         options=config, backend="torch")
    out.grad_sq_norm_mean = torch.stack(g_sq).mean().item()
    (dlogp,) = torch.autograd.grad(out.loss, leaf)
    grads = torch.autograd.grad((logp * dlogp).sum(), params)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    clip = min(1.0, config.grad_clip / (total.item() + 1e-6))
    for p, g in zip(params, grads):
        p.grad = g * clip
    lr_scale = out.lr_scale.item()
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    optimizer.step()
    return out, total.item()


@pytest.mark.parametrize("fused, tied", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("case", ["bookkeeping", "two_pass", "token-level-old", "lm_head", "length"])
def test_step_matches_hand_assembled_update(case, fused, tied, monkeypatch):
    if tied and case in ("lm_head", "length"):
        pytest.skip("the hand-made G_i of these proxies is for an untied head")
    model = tiny_llama(tied=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    options = dict(ess_base_ratio=1.0, grad_clip=0.05, backend="cpu", fused_lm_head=fused)
    with_old = False
    if case == "two_pass":
        options["assembly"] = "two_pass"
    elif case == "token-level-old":
        options.update(is_level="token", clip_ratio=(0.2, 0.2))
        with_old = True
    elif case in ("lm_head", "length"):
        options["grad_norms"] = case
    config = vcpo.VCPOConfig(**options)
    batch = rollout_batch(model, with_old=with_old)
    reference = copy.deepcopy(model)
    # SGD: its update is linear in the gradient (Adam's g / sqrt(v) would amplify last-digit differences of
    # near-zero gradients); AdamW with the scaled lr is tested in test_api.
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2, weight_decay=0.1)

    calls = []
    original = vcpo.PerSequenceGradients.assemble
    monkeypatch.setattr(vcpo.PerSequenceGradients, "assemble",
                        lambda self, c: (calls.append(1), original(self, c))[1])
    if fused:  # the fused step never calls the LM head module (no [B, T, V] logits)
        def refuse(*_):
            raise AssertionError("the LM head module was called")
        model.get_output_embeddings().register_forward_hook(refuse)
    metrics = vcpo.step(model, opt, batch, config)
    assert bool(calls) == (case == "bookkeeping")  # auto picks book-keeping exactly where it is exact

    if case in ("lm_head", "length"):  # the reference's G_i for these proxies
        mask = batch.loss_mask[:, 1:] != 0
        if case == "length":
            g_override = mask.sum(1).double()
        else:
            head = reference.get_output_embeddings().weight
            logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            lp = token_logp(logits[:, :-1], batch.input_ids[:, 1:])
            g_override = torch.stack([torch.autograd.grad((lp[i] * mask[i]).sum(), head, retain_graph=True)[0]
                                      .pow(2).sum() for i in range(6)])
        _reference_update_with(reference, ref_opt, batch, config, g_override)
    else:
        out, total = _reference_update(reference, ref_opt, batch, config)
        assert metrics["grad_sq_norm_mean"] == pytest.approx(out.grad_sq_norm_mean, rel=1e-9)
        assert metrics["grad_norm"] == pytest.approx(total, rel=1e-6)
        assert metrics["lr_scale"] == pytest.approx(out.lr_scale.item(), rel=1e-6)
        assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-6, abs=1e-12)
        assert metrics["baseline_mean"] == pytest.approx(out.baseline.mean().item(), rel=1e-6, abs=1e-12)
        valid = (batch.loss_mask[:, 1:] != 0).any(1)
        assert metrics["advantage_abs_mean"] == pytest.approx(out.advantages[valid].abs().mean().item(), rel=1e-6)
    assert 0 < metrics["lr_scale"] < 1  # off-policy batch: the step is scaled down
    assert opt.param_groups[0]["lr"] == 1e-2  # restored after the step
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")


def _reference_update_with(model, optimizer, batch, config, grad_sq_norm):
    params = list(model.parameters())
    mask = batch.loss_mask[:, 1:] != 0
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logp(logits[:, :-1], batch.input_ids[:, 1:])
    leaf = logp.detach().requires_grad_()
    out = vk.policy_loss(leaf, batch.behavior_logp[:, 1:], mask=mask, rewards=batch.rewards,
                         group_index=batch.group_index, grad_sq_norm=grad_sq_norm, options=config, backend="torch")
    (dlogp,) = torch.autograd.grad(out.loss, leaf)
    grads = torch.autograd.grad((logp * dlogp).sum(), params)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    for p, g in zip(params, grads):
        p.grad = g * min(1.0, config.grad_clip / (total.item() + 1e-6))
    for group in optimizer.param_groups:
        group["lr"] *= out.lr_scale.item()
    optimizer.step()


def test_step_refuses_bookkeeping_where_it_is_not_exact():
    model = tiny_llama()
    batch = rollout_batch(model, with_old=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bookkeeping"):
        vcpo.step(model, opt, batch, vcpo.VCPOConfig(assembly="bookkeeping"))


def test_fused_lm_head_refuses_models_it_cannot_run():
    model = tiny_llama()
    batch = rollout_batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.config.logit_scale = 2.0  # a rescaled head (softcapped logits are handled: test_architectures.py)
    with pytest.raises(ValueError, match="logit_scale"):
        vcpo.step(model, opt, batch, vcpo.VCPOConfig(fused_lm_head=True))
    with pytest.raises(ValueError, match="get_output_embeddings"):
        vcpo.step(torch.nn.Sequential(torch.nn.Linear(2, 2)), opt, batch, vcpo.VCPOConfig(fused_lm_head=True))


def test_step_config_errors():
    for bad in (dict(grad_norms="full"), dict(assembly="one_pass"), dict(grad_clip=0.0), dict(fused_lm_head=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            vcpo.VCPOConfig(**bad)
