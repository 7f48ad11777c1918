"""vcpo.step with micro_batch_size against the whole-batch step (itself checked against a per-sequence backward
loop in test_step.py): the same update, ESS, lr scale, baselines, G_i and gradient norm, for every loss_agg_mode
and gradient path, tied and untied tiny Llama and Qwen2 models, with empty sequences, a micro-batch without a
counted token and a one-member group; and which path (forwards, book-keeping) each configuration takes."""

import functools
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import vcpo
from vcpo.step import token_logp

step_module = importlib.import_module("vcpo.step")  # the module (vcpo.step is the function)

transformers = pytest.importorskip("transformers")

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# Groups (not contiguous) in order of first appearance: 0 (rows 0 2 6), 1 (rows 1 4 7, no counted token),
# 3 (rows 3 8; row 8 has no counted token), 2 (row 5, one member). micro_batch_size 3: [g0] [g1] [g3 g2], the
# second without a counted token; 6: [g0 g1] [g3 g2]; 9: all, in one micro-batch cut to the longest row.
GROUPS = [0, 1, 0, 3, 1, 2, 0, 1, 3]
LENGTHS = [12, 5, 9, 11, 6, 7, 10, 4, 8]  # attended tokens, right padding to T = 14
PROMPTS = [3, 5, 2, 4, 6, 3, 4, 4, 8]  # tokens that do not count: rows 1, 4, 7 and 8 count none
MICRO = {3: 3, 6: 2, 9: 1}  # micro_batch_size -> number of micro-batches
# Gradient paths: each micro-batch's coefficients known after its own norm pass, its gradient by book-keeping
# or by a backward of its kept graph; or, where the advantages need the whole batch, a norm pass over every
# micro-batch and then a second forward and backward of each ("recompute"; with one micro-batch its records or
# graph wait for the whole batch's loss instead).
PATHS = {
    "bookkeeping": (dict(), "per micro-batch"),
    "two_pass": (dict(assembly="two_pass"), "per micro-batch"),
    "token-level-old": (dict(is_level="token", clip_ratio=(0.2, 0.2)), "per micro-batch"),
    "lm_head": (dict(grad_norms="lm_head", advantage="grpo"), "per micro-batch"),
    "fused": (dict(fused_lm_head=True), "per micro-batch"),
    "batch-scope": (dict(opob_scope="batch"), "recompute"),
    "fused-lm_head-batch-scope": (dict(fused_lm_head=True, grad_norms="lm_head", opob_scope="batch"), "recompute"),
    "reinforce-length": (dict(advantage="reinforce", grad_norms="length"), "recompute"),
    "token-rejection-median": (dict(rejection=(("token_k2", None, 0.1),), opob_aggregation="median"),
                               "per micro-batch"),
    "batch-normalize": (dict(is_batch_normalize=True, is_threshold=1.5), "recompute"),
    "gspo-bypass": (dict(trust_region="gspo", clip_ratio=(0.01, 0.01), is_correction="none"), "per micro-batch"),
    "m2po": (dict(rejection=(("batch_m2", None, 0.2),), is_level="token"), "recompute"),
    # with old_logp, Delta = old_logp - behaviour is known before any forward: the threshold first, no recompute
    "m2po-old": (dict(rejection=(("batch_m2", None, 0.1),), is_level="token", clip_ratio=(0.2, 0.2)),
                 "per micro-batch"),
}


def _bookkept(options) -> bool:
    """Whether the gradient is book-kept (the step's assembly="auto") where the coefficients allow it."""
    return (options.get("grad_norms", "exact") == "exact" and options.get("assembly") != "two_pass"
            and options.get("is_level") != "token" and "trust_region" not in options
            and not any(n.startswith(("token_", "batch_")) for n, _, _ in options.get("rejection", ())))


def _model(kind, tied, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    sizes = dict(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied)
    config = (transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config)(**sizes)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # Qwen2's attention biases start at zero: random ones, so their gradients count
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.1)
    return model


def _batch(model, with_old=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    b, t = len(GROUPS), 14
    ids = torch.randint(1, 48, (b, t), generator=g)
    cols = torch.arange(t)
    attention = (cols < torch.tensor(LENGTHS)[:, None]).long()
    loss_mask = attention * (cols >= torch.tensor(PROMPTS)[:, None])
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # the log-probs' dtype
    with torch.no_grad():
        current = torch.zeros(b, t, dtype=dtype)
        current[:, 1:] = token_logp(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
    # weights far enough from 1 that some are truncated at C = 8
    behavior = current + 0.5 * torch.randn(b, t, generator=g, dtype=dtype)
    old = current + 0.1 * torch.randn(b, t, generator=g, dtype=dtype) if with_old else None
    rewards = torch.rand(b, generator=g).round(decimals=1).to(dtype)
    return vcpo.RolloutBatch(ids, attention, loss_mask, behavior, rewards, group_index=torch.tensor(GROUPS),
                             num_groups=4, old_logp=old)


class _Spy:
    """Records the whole batch's loss inputs and outputs in vcpo.step (G_i, baselines, advantages), how many
    forwards of the model's body ran and how many micro-batches were book-kept."""

    def __init__(self, monkeypatch, model):
        self.forwards, self.assembled, self.calls = 0, 0, []
        original_loss, original_assemble = step_module.policy_loss, vcpo.PerSequenceGradients.assemble

        def loss(*args, **kwargs):
            out = original_loss(*args, **kwargs)
            self.calls.append((kwargs["grad_sq_norm"], out.baseline.detach().clone(), out.advantages.detach().clone()))
            return out

        def assemble(psg, coefficients):
            self.assembled += 1
            return original_assemble(psg, coefficients)

        monkeypatch.setattr(step_module, "policy_loss", loss)
        monkeypatch.setattr(vcpo.PerSequenceGradients, "assemble", assemble)
        model.base_model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))


def _run(kind, tied, options, micro, monkeypatch, dtype=torch.float32, with_old=False, mutate=None):
    model = _model(kind, tied, dtype)
    if mutate is not None:
        mutate(model)
    batch = _batch(model, with_old=with_old)
    spy = _Spy(monkeypatch, model)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # No clipping: a wrong gradient scale would be hidden by clipping to the same norm.
    metrics = vcpo.step(model, opt, batch, vcpo.VCPOConfig(grad_clip=None, micro_batch_size=micro, **options))
    update = [p.detach() - q for p, q in zip(model.parameters(), before)]
    monkeypatch.undo()
    return dict(update=update, metrics=metrics, spy=spy)


@functools.lru_cache(maxsize=None)
def _whole(kind, tied, options_key, dtype=torch.float32, with_old=False):
    """The whole-batch step of the same configuration (cached: several micro-batch sizes compare with it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run(kind, tied, dict(options_key), None, monkeypatch, dtype, with_old)


def _check(got, want, num_micro, options, path, tol=1e-5):
    spy = got["spy"]
    # the path: one forward per micro-batch, or two (the norm pass over all, then a second pass of each)
    recompute = path == "recompute" and num_micro > 1
    assert spy.forwards == (2 if recompute else 1) * num_micro
    assert spy.assembled == (num_micro if _bookkept(options) and not recompute else 0)
    scale = max(u.abs().max() for u in want["update"])
    assert scale > 0
    for a, b in zip(got["update"], want["update"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=tol, abs=tol * 1e-2), key
    (g_got, baseline_got, adv_got), (g_want, baseline_want, adv_want) = spy.calls[-1], want["spy"].calls[-1]
    if g_want is None:
        assert g_got is None
    else:
        torch.testing.assert_close(g_got, g_want, rtol=tol, atol=0)
    torch.testing.assert_close(baseline_got, baseline_want, rtol=tol, atol=tol * 1e-2)
    torch.testing.assert_close(adv_got, adv_want, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("micro", list(MICRO))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", list(PATHS))
def test_micro_batched_step_equals_whole_batch_step(path, mode, micro, monkeypatch):
    options, kind = PATHS[path]
    options = dict(options, loss_agg_mode=mode)
    with_old = path in ("token-level-old", "m2po-old")
    got = _run("llama", False, options, micro, monkeypatch, with_old=with_old)
    # A second forward of each micro-batch is a plain backward: compared with the whole batch's (book-keeping
    # agrees with it to float32 rounding only).
    ref = dict(options, assembly="two_pass") if kind == "recompute" else options
    want = _whole("llama", False, tuple(sorted(ref.items())), with_old=with_old)
    _check(got, want, MICRO[micro], options, kind)


@pytest.mark.parametrize("micro", list(MICRO))
@pytest.mark.parametrize("path", ["bookkeeping", "fused", "two_pass"])
@pytest.mark.parametrize("kind, tied", [("llama", True), ("qwen2", False), ("qwen2", True)])
def test_micro_batches_on_tied_and_untied_models(kind, tied, path, micro, monkeypatch):
    options, how = PATHS[path]
    got = _run(kind, tied, options, micro, monkeypatch)
    _check(got, _whole(kind, tied, tuple(sorted(options.items()))), MICRO[micro], options, how)


@pytest.mark.parametrize("path", ["bookkeeping", "batch-scope"])
def test_micro_batches_in_float64(path, monkeypatch):
    """In float64 the micro-batched step is the whole batch's to rounding."""
    options, kind = PATHS[path]
    ref = dict(options, assembly="two_pass") if kind == "recompute" else options
    got = _run("llama", False, options, 3, monkeypatch, dtype=torch.float64)
    _check(got, _whole("llama", False, tuple(sorted(ref.items())), torch.float64), 3, options, kind, tol=1e-10)


def test_micro_batches_in_bfloat16(monkeypatch):
    """A bf16 model: log-probs and norms in fp32, the coefficients in fp64, the update rounded to bf16 (and the
    micro-batches' shorter GEMMs round differently): the whole batch's step to bf16 accuracy."""
    got = _run("llama", False, {}, 3, monkeypatch, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        want = _run("llama", False, {}, None, mp, dtype=torch.bfloat16)
    assert got["spy"].forwards == 3 and got["spy"].assembled == 3
    for key in ("ess_ratio", "lr_scale", "grad_norm", "grad_sq_norm_mean", "loss", "baseline_mean"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=2e-2, abs=1e-3), key
    flat = lambda u: torch.cat([x.float().reshape(-1) for x in u])  # noqa: E731
    a, b = flat(got["update"]), flat(want["update"])
    assert torch.linalg.vector_norm(a - b) <= 2e-2 * torch.linalg.vector_norm(b)


class _DirectDownProj(torch.nn.Module):
    """An MLP projection whose weight its parent uses directly: exact norms refuse it (the hooks cannot see
    that use), while the computation stays per sequence."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return F.linear(x, self.inner.weight)


def test_auto_falls_back_to_the_head_norm_with_micro_batches(monkeypatch):
    def mutate(model):
        model.model.layers[0].mlp.down_proj = _DirectDownProj(model.model.layers[0].mlp.down_proj)

    with pytest.warns(UserWarning, match="LM head's norm"):
        got = _run("llama", False, dict(grad_norms="auto"), 3, monkeypatch, mutate=mutate)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _run("llama", False, dict(grad_norms="lm_head"), None, mp, mutate=mutate)
    got["spy"].forwards -= 1  # the refused first micro-batch's forward, before the step started again
    _check(got, want, 3, dict(grad_norms="lm_head"), "per micro-batch")


def test_micro_batch_size_errors():
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="micro_batch_size"):
            vcpo.VCPOConfig(micro_batch_size=bad)
    model = _model("llama", False)
    batch = _batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"micro_batch_size=2 .*prompt group 0 has 3 sequences"):
        vcpo.step(model, opt, batch, vcpo.VCPOConfig(micro_batch_size=2))
    one_group = vcpo.RolloutBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.behavior_logp,
                                  batch.rewards)
    with pytest.raises(ValueError, match=r"micro_batch_size=8 .*one prompt group \(group_index is None\)"):
        vcpo.step(model, opt, one_group, vcpo.VCPOConfig(micro_batch_size=8))
    with pytest.raises(ValueError, match=r"assembly='bookkeeping' with micro_batch_size=3: opob_scope='batch'"):
        vcpo.step(model, opt, batch, vcpo.VCPOConfig(micro_batch_size=3, assembly="bookkeeping",
                                                     opob_scope="batch"))
    bad_groups = vcpo.RolloutBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.behavior_logp,
                                   batch.rewards, group_index=torch.tensor(GROUPS), num_groups=3)
    with pytest.raises(ValueError, match=r"group_index must be in \[0, num_groups\) = \[0, 3\)"):
        vcpo.step(model, opt, bad_groups, vcpo.VCPOConfig(micro_batch_size=3))
    # nothing was stepped by the refused calls
    fresh = _model("llama", False)
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
