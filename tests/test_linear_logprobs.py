"""vcpo_kernels.linear_logprobs against a naive float64 statement (full logits, autograd): log-probs,
entropy, sum p^2, gradients for any upstream gradient, per-sequence LM-head norms, memory, bad input."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vcpo_kernels as vk


def naive(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=-100):
    """Materialised float64 logits: (logp, entropy, sum p^2), 0 where the target is ignored."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z / temperature
    logq = torch.log_softmax(z, -1)
    keep = targets != ignore_index
    y = torch.where(keep, targets, 0)
    logp = torch.where(keep, logq.gather(-1, y[:, None])[:, 0], 0)
    p = logq.exp()
    entropy = torch.where(keep, -(p * logq).sum(-1), 0)
    sum_p2 = torch.where(keep, (p * p).sum(-1), 0)
    return logp, entropy, sum_p2


def make(n, h, v, dtype=torch.float32, bias=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


def grads_of(outputs, upstream, inputs):
    total = sum((o.double() * u).sum() for o, u in zip(outputs, upstream))
    return torch.autograd.grad(total, [t for t in inputs if t is not None])


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 2e-4)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 64])
def test_outputs_and_gradients_match_float64(dtype, tol, temperature, chunk):
    hidden, weight, bias, targets = make(10, 16, 37, dtype, seed=chunk)  # V = 37: no multiple of a chunk
    targets[0], targets[1], targets[2] = 0, 36, -100  # the vocabulary's ends and an ignored target
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=True,
                             return_sum_p2=True, chunk_size=chunk)
    assert out.logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the float64 statement on the very same (rounded) inputs
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = naive(h64, w64, targets, b64, temperature)
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert out.logp[2] == 0 and out.entropy[2] == 0 and out.sum_p2[2] == 0
    g = torch.Generator().manual_seed(1)
    upstream = [torch.randn(10, generator=g, dtype=torch.float64) for _ in range(3)]
    got = grads_of((out.logp, out.entropy, out.sum_p2), upstream, (hidden, weight, bias))
    want = grads_of(ref, upstream, (h64, w64, b64))
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == dtype
        scale = b.abs().max().item()
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10 * scale, msg=name)


@pytest.mark.parametrize("which", ["logp", "entropy", "sum_p2"])
def test_each_output_alone_has_its_own_gradient(which):
    hidden, weight, bias, targets = make(6, 8, 11, torch.float64, seed=3)
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, return_sum_p2=True,
                             chunk_size=4)
    index = ("logp", "entropy", "sum_p2").index(which)
    ref = naive(hidden, weight, targets, bias)
    got = torch.autograd.grad(getattr(out, which).sum(), (hidden, weight, bias))
    want = torch.autograd.grad(ref[index].sum(), (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_float64():
    hidden, weight, bias, targets = make(4, 5, 7, torch.float64, seed=4)
    targets[1] = -100

    def f(h, w, b):
        o = vk.linear_logprobs(h, w, targets, bias=b, temperature=0.9, return_entropy=True, return_sum_p2=True,
                               chunk_size=3)
        return o.logp, o.entropy, o.sum_p2

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_one_token_no_bias_and_extreme_logits():
    hidden, weight, _, targets = make(1, 4, 9, torch.float32, bias=False, seed=5, scale=300.0)  # |z| ~ 1e3
    out = vk.linear_logprobs(hidden, weight, targets, return_entropy=True, return_sum_p2=True)
    ref = naive(hidden.detach(), weight.detach(), targets)
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    out.logp.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_ignored_targets_contribute_nothing():
    hidden, weight, bias, targets = make(8, 6, 13, torch.float64, seed=6)
    ignored = torch.tensor([1, 4, 5])
    targets[ignored] = -1
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, ignore_index=-1, return_entropy=True)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert (hidden.grad[ignored] == 0).all()
    kept = torch.tensor([0, 2, 3, 6, 7])
    h2 = hidden.detach()[kept].requires_grad_()
    w2, b2 = weight.detach().requires_grad_(), bias.detach().requires_grad_()
    ref = naive(h2, w2, targets[kept], b2)
    (ref[0].sum() + ref[1].sum()).backward()
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bias.grad, b2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [2, 5, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_per_sequence_lm_head_norms_match_a_loop(chunk, bias):
    lengths = [3, 0, 7, 1, 4]  # an empty sequence, one longer than the small chunks
    n = sum(lengths)
    hidden, weight, b, targets = make(n, 6, 11, torch.float64, bias=bias, seed=7)
    targets[4] = -100
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    norms = torch.full((5,), 0.5, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, bias=b, cu_seqlens=cu, seq_grad_sq_norm=norms,
                             chunk_size=chunk)
    (out.logp * upstream).sum().backward()
    params = [weight] + ([b] if bias else [])
    for i in range(5):
        s, e = int(cu[i]), int(cu[i + 1])
        w_i = weight.detach().clone().requires_grad_()
        b_i = b.detach().clone().requires_grad_() if bias else None
        lp = naive(hidden.detach()[s:e], w_i, targets[s:e], b_i)[0]
        want = 0.0
        if e > s:
            grads = torch.autograd.grad((lp * upstream[s:e]).sum(), [w_i] + ([b_i] if bias else []))
            want = sum(gr.pow(2).sum().item() for gr in grads)
        assert norms[i].item() == pytest.approx(0.5 + want, rel=1e-10, abs=1e-12), i  # added to what was there
    # and the summed gradient is unchanged by the per-sequence walk
    w_all = weight.detach().clone().requires_grad_()
    b_all = b.detach().clone().requires_grad_() if bias else None
    grads = torch.autograd.grad((naive(hidden.detach(), w_all, targets, b_all)[0] * upstream).sum(),
                                [w_all] + ([b_all] if bias else []))
    for p, want in zip(params, grads):
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_n_by_v():
    n, h, v, chunk = 256, 8, 512, 16
    hidden, weight, bias, targets = make(n, h, v, seed=8)
    with _LargestTensor() as mode:
        out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, return_sum_p2=True,
                                 chunk_size=chunk)
        (out.logp.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
    assert mode.largest <= chunk * v < n * v  # every temporary is at most one chunk of logits


@pytest.mark.parametrize("kwargs, match", [
    ({"targets": torch.tensor([0, 99])}, "targets must be in"),
    ({"targets": torch.tensor([0.0, 1.0])}, "targets must be an int"),
    ({"hidden": torch.randn(2, 5)}, "hidden must be"),
    ({"bias": torch.randn(3)}, "bias must have shape"),
    ({"temperature": 0.0}, "temperature"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"seq_grad_sq_norm": torch.zeros(1)}, "needs cu_seqlens"),
    ({"cu_seqlens": torch.tensor([0, 2])}, "only used with"),
    ({"cu_seqlens": torch.tensor([0, 3]), "seq_grad_sq_norm": torch.zeros(1)}, "rise from 0 to N"),
    ({"backend": "cpu"}, "no 'cpu' kernel yet"),
])
def test_bad_input_names_the_argument(kwargs, match):
    args = {"hidden": torch.randn(2, 4), "weight": torch.randn(7, 4), "targets": torch.tensor([0, 6])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vk.linear_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


def test_frozen_head_still_gives_hidden_gradients_and_norms():
    """A frozen LM head (requires_grad False) skips its weight gradient, not the per-sequence norms."""
    hidden, weight, bias, targets = make(9, 5, 13, torch.float64, seed=9)
    frozen_w, frozen_b = weight.detach(), bias.detach()
    cu = torch.tensor([0, 4, 9])
    norms = torch.zeros(2, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, frozen_w, targets, bias=frozen_b, cu_seqlens=cu, seq_grad_sq_norm=norms,
                             chunk_size=3)
    (d_hidden,) = torch.autograd.grad(out.logp.sum(), hidden)
    h2 = hidden.detach().requires_grad_()
    (want,) = torch.autograd.grad(naive(h2, frozen_w, targets, frozen_b)[0].sum(), h2)
    torch.testing.assert_close(d_hidden, want, rtol=1e-10, atol=1e-12)
    for i in range(2):
        w_i, b_i = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        s, e = int(cu[i]), int(cu[i + 1])
        grads = torch.autograd.grad(naive(hidden.detach()[s:e], w_i, targets[s:e], b_i)[0].sum(), (w_i, b_i))
        assert norms[i].item() == pytest.approx(sum(g.pow(2).sum().item() for g in grads), rel=1e-10)
