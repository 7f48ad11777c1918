"""vcpo_kernels.linear_logprobs against a naive float64 statement (full logits, autograd): log-probs,
entropy, sum p^2, gradients for any upstream gradient, per-sequence LM-head norms, memory, bad input."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vcpo_kernels as vk
from helpers import COMPILED_BACKENDS, poison_heap


@pytest.fixture(params=["torch"] + COMPILED_BACKENDS)
def backend(request):
    return request.param


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
def test_outputs_and_gradients_match_float64(dtype, tol, temperature, chunk, backend):
    hidden, weight, bias, targets = make(10, 16, 37, dtype, seed=chunk)  # V = 37: no multiple of a chunk
    targets[0], targets[1], targets[2] = 0, 36, -100  # the vocabulary's ends and an ignored target
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, temperature=temperature,
                             return_entropy=True, return_sum_p2=True, chunk_size=chunk)
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
def test_each_output_alone_has_its_own_gradient(which, backend):
    hidden, weight, bias, targets = make(6, 8, 11, torch.float64, seed=3)
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, return_entropy=True,
                             return_sum_p2=True,
                             chunk_size=4)
    index = ("logp", "entropy", "sum_p2").index(which)
    ref = naive(hidden, weight, targets, bias)
    got = torch.autograd.grad(getattr(out, which).sum(), (hidden, weight, bias))
    want = torch.autograd.grad(ref[index].sum(), (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_float64(backend):
    hidden, weight, bias, targets = make(4, 5, 7, torch.float64, seed=4)
    targets[1] = -100

    def f(h, w, b):
        o = vk.linear_logprobs(h, w, targets, bias=b, temperature=0.9, return_entropy=True, return_sum_p2=True,
                               backend=backend,
                               chunk_size=3)
        return o.logp, o.entropy, o.sum_p2

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_one_token_no_bias_and_extreme_logits(backend):
    hidden, weight, _, targets = make(1, 4, 9, torch.float32, bias=False, seed=5, scale=300.0)  # |z| ~ 1e3
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, return_entropy=True, return_sum_p2=True)
    ref = naive(hidden.detach(), weight.detach(), targets)
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    out.logp.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_ignored_targets_contribute_nothing(backend):
    hidden, weight, bias, targets = make(8, 6, 13, torch.float64, seed=6)
    ignored = torch.tensor([1, 4, 5])
    targets[ignored] = -1
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, ignore_index=-1, return_entropy=True)
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
def test_per_sequence_lm_head_norms_match_a_loop(chunk, bias, backend):
    lengths = [3, 0, 7, 1, 4]  # an empty sequence, one longer than the small chunks
    n = sum(lengths)
    hidden, weight, b, targets = make(n, 6, 11, torch.float64, bias=bias, seed=7)
    targets[4] = -100
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    norms = torch.full((5,), 0.5, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=b, cu_seqlens=cu, seq_grad_sq_norm=norms,
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


def test_never_materialises_n_by_v(backend):
    if backend == "triton":
        pytest.skip("the Triton interpreter stages kernel arguments through host copies of their storage")
    n, h, v, chunk = 256, 8, 512, 16
    hidden, weight, bias, targets = make(n, h, v, seed=8)
    with _LargestTensor() as mode:
        out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, return_entropy=True,
                                 return_sum_p2=True, chunk_size=chunk)
        (out.logp.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
    assert mode.largest <= chunk * v < n * v  # every temporary is at most one chunk of logits


@pytest.mark.parametrize("kwargs, match", [
    ({"targets": torch.tensor([0, 99])}, "targets must be in"),
    ({"targets": torch.tensor([0.0, 1.0])}, "targets must be an int"),
    ({"hidden": torch.randn(2, 5)}, "hidden must be"),
    ({"bias": torch.randn(3)}, "bias must have shape"),
    ({"temperature": 0.0}, "temperature"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"seq_grad_sq_norm": torch.zeros(1)}, "need cu_seqlens"),
    ({"cu_seqlens": torch.tensor([0, 2])}, "only used with"),
    ({"cu_seqlens": torch.tensor([0, 3]), "seq_grad_sq_norm": torch.zeros(1)}, "rise from 0 to N"),
    ({"seq_grad_rows": torch.zeros(1, 1, 4)}, "go together"),
    ({"cu_seqlens": torch.tensor([0, 2]), "seq_grad_row_ids": torch.zeros(1, 1, dtype=torch.long),
      "seq_grad_rows": torch.zeros(1, 2, 4)}, "seq_grad_rows must be"),
    ({"cu_seqlens": torch.tensor([0, 2]), "seq_grad_row_ids": torch.tensor([[7]]),
      "seq_grad_rows": torch.zeros(1, 1, 4)}, "seq_grad_row_ids must be in"),
    ({"backend": "cuda"}, "backend='cuda'"),
])
def test_bad_input_names_the_argument(kwargs, match, backend):
    args = {"hidden": torch.randn(2, 4), "weight": torch.randn(7, 4), "targets": torch.tensor([0, 6])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vk.linear_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **{"backend": backend, **args})


def test_frozen_head_still_gives_hidden_gradients_and_norms(backend):
    """A frozen LM head (requires_grad False) skips its weight gradient, not the per-sequence norms."""
    hidden, weight, bias, targets = make(9, 5, 13, torch.float64, seed=9)
    frozen_w, frozen_b = weight.detach(), bias.detach()
    cu = torch.tensor([0, 4, 9])
    norms = torch.zeros(2, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, frozen_w, targets, backend=backend, bias=frozen_b, cu_seqlens=cu,
                             seq_grad_sq_norm=norms,
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


def test_several_blocks_per_row_with_the_maximum_last(backend):
    """V spans several of the Triton kernels' column blocks and the row maximum sits in the last one, so the
    running sums are rescaled; also the V = 1 vocabulary."""
    hidden, weight, bias, targets = make(4, 6, 9000, torch.float64, seed=10)
    with torch.no_grad():
        weight[8990:] *= 6.0  # the largest logits at the end of the row
    targets[0], targets[1] = 8995, 0
    poison_heap(4, 4 * 9000)
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, return_sum_p2=True,
                             chunk_size=3, backend=backend)
    ref = naive(hidden.detach(), weight.detach(), targets, bias.detach())
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(out.logp.sum() + out.entropy.sum() + out.sum_p2.sum(), (hidden, weight, bias))
    want = torch.autograd.grad(sum(r.sum() for r in naive(hidden, weight, targets, bias)), (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    one = vk.linear_logprobs(hidden, weight[:1], torch.zeros(4, dtype=torch.long), return_entropy=True,
                             return_sum_p2=True, backend=backend)
    assert (one.logp == 0).all() and (one.entropy.abs() < 1e-12).all() and (one.sum_p2 == 1).all()


def test_non_finite_hidden_gives_nan_not_a_silent_number(backend):
    hidden, weight, bias, targets = make(3, 4, 10, seed=11)
    with torch.no_grad():
        hidden[1, 2] = float("nan")
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, backend=backend)
    assert torch.isnan(out.logp[1]) and torch.isnan(out.entropy[1])
    assert torch.isfinite(out.logp[[0, 2]]).all()


@pytest.mark.parametrize("chunk", [2, 100])
def test_per_sequence_gradient_rows_match_a_loop(chunk, backend):
    """seq_grad_rows[i, k] += (d W of sequence i)[seq_grad_row_ids[i, k]]: what the inner product with a tied
    embedding's per-sequence gradient needs."""
    lengths = [4, 0, 5]
    n, v, h = sum(lengths), 12, 5
    hidden, weight, b, targets = make(n, h, v, torch.float64, seed=12)
    cu = torch.tensor([0, 4, 4, 9])
    ids = torch.randint(0, v, (3, 6), generator=torch.Generator().manual_seed(3))
    ids[0, 0] = ids[0, 1]  # a repeated id
    rows = torch.full((3, 6, h), 0.25, dtype=torch.float64)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, bias=b, cu_seqlens=cu, seq_grad_row_ids=ids,
                             seq_grad_rows=rows, chunk_size=chunk, backend=backend)
    (out.logp * upstream).sum().backward()
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        w_i = weight.detach().clone().requires_grad_()
        want = torch.zeros(v, h, dtype=torch.float64)
        if e > s:
            (want,) = torch.autograd.grad((naive(hidden.detach()[s:e], w_i, targets[s:e], b.detach())[0]
                                           * upstream[s:e]).sum(), w_i)
        torch.testing.assert_close(rows[i], 0.25 + want[ids[i]], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif("cpu" not in COMPILED_BACKENDS, reason="the C++ extension is not built")
def test_cpu_row_ops_pass_opcheck_and_reject_bad_targets():
    g = torch.Generator().manual_seed(13)
    z = torch.randn(5, 7, generator=g)
    y = torch.tensor([0, 6, -100, 3, 2])
    torch.library.opcheck(torch.ops.vcpo.logit_rows_forward.default, (z, y, -100))
    lse = torch.logsumexp(z, -1)
    grads = [torch.randn(5, generator=g) for _ in range(5)]
    torch.library.opcheck(torch.ops.vcpo.logit_rows_backward.default, (z.clone(), lse, y, -100, *grads, 0.5))
    with pytest.raises(RuntimeError, match="targets must lie in"):
        torch.ops.vcpo.logit_rows_forward(z, torch.tensor([0, 7, 0, 0, 0]), -100)
    with pytest.raises(RuntimeError, match="g_entropy needs"):
        torch.ops.vcpo.logit_rows_backward(z, lse, y, -100, None, grads[0], None, None, None, 1.0)
