"""Top-k / top-p sampling (docs/contract.md, "Truncated sampling"): the support against a per-row loop written from
the rule and against vLLM's own function; linear_logprobs and token_logp against float64 log-probs over a
brute-force support, their gradients, per-sequence norms and targets outside the support; the loss's zero weight
and its KL for such tokens, on every backend."""

import math

import pytest
import torch

import vcpo_kernels as vk
from vcpo.step import token_logp
from vcpo_kernels import truncation as support_module
from support.backend_check import COMPILED_BACKENDS

SETTINGS = [(5, 1.0), (-1, 0.8), (10, 0.7), (0, 0.3), (3, 0.999), (1, 1.0), (-1, 1e-6)]


@pytest.fixture(params=["torch"] + COMPILED_BACKENDS)
def backend(request):
    return request.param


def loop_support(z, top_k, top_p):
    """The rule, one row at a time in float64 Python: top-k keeps every logit >= the k-th largest; top-p walks the
    remaining tokens from the least likely up, dropping each while the mass dropped so far, with it, is <= 1 - p."""
    keep = torch.zeros(z.shape, dtype=torch.bool)
    for r, row in enumerate(z.double().tolist()):
        kept = set(range(len(row)))
        if 0 < top_k < len(row):
            kth = sorted(row, reverse=True)[top_k - 1]
            kept = {v for v in kept if row[v] >= kth}
        if top_p < 1:
            top = max(row[v] for v in kept)
            total = sum(math.exp(row[v] - top) for v in kept)
            mass = 0.0
            for v in sorted(kept, key=lambda v: row[v])[:-1]:  # ascending; the most likely is never dropped
                mass += math.exp(row[v] - top) / total
                if mass > 1 - top_p:
                    break
                kept.discard(v)
        keep[r, sorted(kept)] = True
    return keep


def truncated_naive(hidden, weight, targets, keep, temperature=1.0, softcap=None, ignore_index=-100):
    """float64 (logp, entropy, sum p^2) of softmax(z) over the support `keep`, by autograd: -inf logp outside."""
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logq = torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1)
    ignored = targets == ignore_index
    y = torch.where(ignored, 0, targets)
    inside = keep.gather(1, y[:, None])[:, 0] | ignored
    logp = torch.where(ignored, 0, torch.where(inside, logq.gather(1, y[:, None])[:, 0], -torch.inf))
    p = logq.exp()
    entropy = torch.where(ignored, 0, -(p * torch.where(keep, logq, 0)).sum(-1))  # no 0 * inf in the backward
    sum_p2 = torch.where(ignored, 0, (p * p).sum(-1))
    return logp, entropy, sum_p2


def make(n, h, v, dtype=torch.float64, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    return hidden, weight


def sampled_targets(hidden, weight, keep, seed, temperature=1.0, softcap=None):
    """One token per row drawn from the truncated distribution (what the engine samples), then rows 1 and 3
    moved outside the support (what a support that differs gives) and row 2 ignored."""
    z = (hidden.detach().double() @ weight.detach().double().T)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    probs = torch.softmax((z / temperature).masked_fill(~keep, -torch.inf), -1)
    targets = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    for r in (1, 3):
        outside = (~keep[r]).nonzero()
        if len(outside):
            targets[r] = outside[0, 0]
    targets[2] = -100
    return targets


# -- the support ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k, top_p", SETTINGS + [(50, 1.0), (1000, 0.9)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_support_matches_a_loop_over_the_rule(top_k, top_p, dtype):
    g = torch.Generator().manual_seed(top_k * 7 + int(top_p * 1000))
    z = (torch.randn(40, 50, generator=g) * 3).to(dtype)
    z[0, :6] = z[0, 6]  # ties at the top-k edge: every tied logit is kept
    got = vk.sampling_support(z, top_k, top_p)
    want = loop_support(z.float() if dtype == torch.bfloat16 else z, top_k, top_p)
    assert torch.equal(got, want)
    assert got.any(1).all()  # never an empty support


def test_support_is_formed_in_chunks_of_rows(monkeypatch):
    z = torch.randn(2, 33, 50, generator=torch.Generator().manual_seed(1))
    whole = vk.sampling_support(z, 7, 0.8)
    monkeypatch.setattr(support_module, "_CHUNK_LOGITS", 120)  # two rows a chunk
    assert torch.equal(vk.sampling_support(z, 7, 0.8), whole)
    assert whole.shape == z.shape


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.8), (10, 0.7), (0, 0.3)])
def test_support_is_vllms(top_k, top_p):
    """vLLM's own top-k / top-p function (the sampler's, on CPU) leaves -inf outside the same set."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 4
    k = None if top_k <= 0 else torch.full((64,), top_k, dtype=torch.long)
    p = None if top_p >= 1 else torch.full((64,), top_p)
    theirs = apply_top_k_top_p_pytorch(z.clone(), k, p) > -torch.inf
    assert torch.equal(vk.sampling_support(z, top_k, top_p), theirs)


@pytest.mark.parametrize("top_k, top_p, match", [
    (-2, 1.0, "top_k must be an integer >= 1, or -1 or 0 for off, got -2"),
    (2.0, 1.0, "top_k must be an integer"), (True, 1.0, "top_k must be an integer"),
    (5, 0.0, r"top_p must be a number in \(0, 1\], 1 for off, got 0.0"), (5, 1.5, "top_p must be"),
    (5, float("nan"), "top_p must be"),
])
def test_bad_settings_name_the_setting(top_k, top_p, match):
    with pytest.raises(ValueError, match=match):
        vk.check_sampling(top_k, top_p)
    hidden, weight = make(3, 4, 6)
    with pytest.raises(ValueError, match=match):
        vk.linear_logprobs(hidden, weight, torch.zeros(3, dtype=torch.long), top_k=top_k, top_p=top_p)
    import vcpo

    with pytest.raises(ValueError, match=match):
        vcpo.VCPOConfig(top_k=top_k, top_p=top_p)


# -- log-probs -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k, top_p", SETTINGS)
@pytest.mark.parametrize("softcap, temperature, chunk", [(None, 1.0, 4), (None, 0.7, 64), (2.0, 0.8, 5)])
def test_linear_logprobs_match_float64_over_the_support(top_k, top_p, softcap, temperature, chunk, backend):
    hidden, weight = make(23, 8, 37, seed=top_k + 5)
    z = hidden.detach() @ weight.detach().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = loop_support(z / temperature, top_k, top_p)
    targets = sampled_targets(hidden, weight, keep, seed=1, temperature=temperature, softcap=softcap)
    out = vk.linear_logprobs(hidden, weight, targets, temperature=temperature, softcap=softcap, top_k=top_k,
                             top_p=top_p, return_entropy=True, return_sum_p2=True, chunk_size=chunk, backend=backend)
    want = truncated_naive(hidden, weight, targets, keep, temperature, softcap)
    outputs = (out.logp, out.entropy, out.sum_p2)
    for got, ref in zip(outputs, want):
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    outside = out.logp == -torch.inf
    assert outside.sum() == int(not keep[1].all()) + int(not keep[3].all())
    # the gradients of every output, the -inf log-probs taking none
    g = torch.Generator().manual_seed(4)
    up = [torch.randn(23, generator=g, dtype=torch.float64) for _ in range(3)]

    def total(outputs):
        return sum((torch.where(o == -torch.inf, 0, o) * u).sum() for o, u in zip(outputs, up))

    got = torch.autograd.grad(total(outputs), (hidden, weight))
    ref = torch.autograd.grad(total(want), (hidden, weight))
    for a, b in zip(got, ref):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-4)])
def test_linear_logprobs_in_low_precision(dtype, tol, backend):
    hidden, weight = make(30, 16, 41, dtype=dtype, seed=2, scale=1.0)
    z = hidden.detach().double() @ weight.detach().double().T
    keep = vk.sampling_support(z.float(), 8, 0.9)  # the support the op decides, from fp32 logits
    targets = sampled_targets(hidden, weight, keep, seed=2)
    out = vk.linear_logprobs(hidden, weight, targets, top_k=8, top_p=0.9, backend=backend)
    want = truncated_naive(hidden, weight, targets, keep)[0]
    assert out.logp.dtype == torch.float32
    assert torch.equal(out.logp == -torch.inf, want == -torch.inf)
    fin = want.isfinite()
    torch.testing.assert_close(out.logp[fin].double(), want[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("top_k, top_p", [(4, 1.0), (-1, 0.6), (6, 0.85)])
def test_per_sequence_norms_over_the_support_match_a_loop(top_k, top_p, backend):
    lengths = [3, 0, 7, 1, 4]
    n = sum(lengths)
    hidden, weight = make(n, 6, 11, seed=7)
    keep = loop_support(hidden.detach() @ weight.detach().T, top_k, top_p)
    targets = sampled_targets(hidden, weight, keep, seed=3)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    norms = torch.zeros(5, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, cu_seqlens=cu, seq_grad_sq_norm=norms, top_k=top_k,
                             top_p=top_p, chunk_size=2, backend=backend)
    torch.where(out.logp == -torch.inf, 0, out.logp).sum().backward()  # the norm pass: upstream 1 on every token
    for i in range(5):
        s, e = int(cu[i]), int(cu[i + 1])
        w_i = weight.detach().clone().requires_grad_()
        lp = truncated_naive(hidden.detach()[s:e], w_i, targets[s:e], keep[s:e])[0]
        want = 0.0
        if e > s:
            (gw,) = torch.autograd.grad(torch.where(lp == -torch.inf, 0, lp).sum(), w_i)
            want = gw.pow(2).sum().item()
        assert norms[i].item() == pytest.approx(want, rel=1e-10, abs=1e-12), i


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.8), (10, 0.7)])
def test_token_logp_matches_float64_over_the_support(top_k, top_p):
    hidden, weight = make(2 * 9, 8, 37, seed=11)
    keep = loop_support(hidden.detach() @ weight.detach().T / 0.9, top_k, top_p)
    targets = sampled_targets(hidden, weight, keep, seed=5, temperature=0.9)
    targets[2] = 0  # token_logp has no ignored targets
    logits = (hidden @ weight.T).view(2, 9, 37)
    got = token_logp(logits, targets.view(2, 9), 0.9, top_k, top_p).reshape(-1)
    want = truncated_naive(hidden, weight, targets, keep, 0.9)[0]
    assert torch.equal(got == -torch.inf, want == -torch.inf) and (got == -torch.inf).sum() >= 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (a,) = torch.autograd.grad(torch.where(got.isinf(), 0, got).sum(), weight)
    (b,) = torch.autograd.grad(torch.where(want.isinf(), 0, want).sum(), weight)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # off: the plain log-softmax
    plain = token_logp(logits, targets.view(2, 9), 0.9, -1, 1.0)
    torch.testing.assert_close(plain, torch.log_softmax(logits.double() / 0.9, -1).gather(
        -1, targets.view(2, 9, 1))[..., 0])


# -- the loss ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_level", ["sequence", "token"])
def test_a_token_outside_the_support_has_weight_zero_and_no_kl(is_level, backend):
    """logp = -inf on counted tokens (the trainer's support left them out): the loss and its gradient are finite,
    those tokens (or their sequences, at the sequence level) contribute nothing, and kl_k3 is the other tokens'."""
    g = torch.Generator().manual_seed(9)
    b, t = 6, 5
    mu = -torch.rand(b, t, generator=g, dtype=torch.float64) - 0.1
    logp = mu + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    outside = torch.zeros(b, t, dtype=torch.bool)
    outside[1, 2] = outside[4, 0] = True
    logp = logp.masked_fill(outside, -torch.inf).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    out = vk.policy_loss(logp, mu, rewards=rewards, group_index=groups, is_level=is_level, backend=backend)
    out.loss.backward()
    assert out.loss.isfinite() and logp.grad.isfinite().all()
    assert (logp.grad[outside] == 0).all()
    if is_level == "sequence":
        assert (logp.grad[1] == 0).all() and (logp.grad[4] == 0).all()  # a zero sequence weight
        assert out.seq_log_weight[1] == -torch.inf and out.num_nonfinite == 2
    else:
        assert (logp.grad[1][~outside[1]] != 0).all()
    delta = (logp.detach() - mu)[~outside]
    want_kl = (torch.expm1(delta) - delta).sum() / (b * t)
    assert out.kl_k3.item() == pytest.approx(want_kl.item(), rel=1e-9)
    # and a NaN log-prob still makes the KL NaN
    nan = logp.detach().clone()
    nan[0, 0] = torch.nan
    assert vk.policy_loss(nan, mu, rewards=rewards, group_index=groups, backend=backend).kl_k3.isnan()
