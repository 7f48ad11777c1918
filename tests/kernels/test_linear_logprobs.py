"""vcpo_kernels.linear_logprobs against a naive float64 statement (full logits, autograd): log-probs,
entropy, sum p^2, gradients for any upstream gradient, per-sequence LM-head norms, softcapped logits, memory,
bad input."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vcpo_kernels as vk
from support.backend_check import COMPILED_BACKENDS, poison_heap


@pytest.fixture(params=["torch"] + COMPILED_BACKENDS)
def backend(request):
    return request.param


def naive(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=-100, softcap=None):
    """Materialised float64 logits: (logp, entropy, sum p^2), 0 where the target is ignored. A softcap c caps
    the head's output to c tanh(z / c) before the temperature divides it (Gemma 2/3 in Hugging Face, then
    vLLM's sampler)."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
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
# |z| ~ 1: a softcap that flattens the logits, one that bends them
@pytest.mark.parametrize("chunk, softcap", [(3, None), (64, None), (3, 0.5), (64, 2.0)])
def test_outputs_and_gradients_match_float64(dtype, tol, temperature, chunk, softcap, backend):
    hidden, weight, bias, targets = make(10, 16, 37, dtype, seed=chunk)  # V = 37: no multiple of a chunk
    targets[0], targets[1], targets[2] = 0, 36, -100  # the vocabulary's ends and an ignored target
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, temperature=temperature,
                             softcap=softcap, return_entropy=True, return_sum_p2=True, chunk_size=chunk)
    assert out.logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the float64 statement on the very same (rounded) inputs
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = naive(h64, w64, targets, b64, temperature, softcap=softcap)
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


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_gradcheck_float64(softcap, backend):
    hidden, weight, bias, targets = make(4, 5, 7, torch.float64, seed=4, scale=2.0)
    targets[1] = -100

    def f(h, w, b):
        o = vk.linear_logprobs(h, w, targets, bias=b, temperature=0.9, softcap=softcap, return_entropy=True,
                               return_sum_p2=True, backend=backend, chunk_size=3)
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


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("softcap", [30.0, 0.5])
def test_logits_far_beyond_the_softcap(dtype, tol, softcap, backend):
    """|z| ~ 1e3 against a cap of 30 or 0.5: tanh saturates, the capped logits sit near +-cap and the
    gradients through the cap, 1 - tanh^2 ~ 4 exp(-2 |z| / cap), are ~0 but finite, as in float64. (The
    reference's autograd forms 1 - tanh^2 from tanh, 0 once tanh rounds to +-1 (|z| / cap > 19 in float64);
    the ops keep it relative, so the two differ there by less than 1e-16 of the uncapped gradient: atol 1e-13.)"""
    hidden, weight, bias, targets = make(8, 4, 9, dtype, seed=15, scale=300.0)
    targets[3] = -100
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.8, softcap=softcap,
                             return_entropy=True, return_sum_p2=True, chunk_size=3, backend=backend)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = naive(h64, w64, targets, b64, 0.8, softcap=softcap)
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    upstream = [torch.randn(8, generator=torch.Generator().manual_seed(6), dtype=torch.float64) for _ in range(3)]
    got = grads_of((out.logp, out.entropy, out.sum_p2), upstream, (hidden, weight, bias))
    want = grads_of(ref, upstream, (h64, w64, b64))
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10 * b.abs().max().item() + 1e-13,
                                   msg=name)


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


# Per-sequence outputs of softcapped logits: their d z is chain-ruled through the cap, in every branch of the
# chunk loop (the <dz dz^T, h h^T> of a short sequence in one span included).
CAPS = pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (1.5, 0.8)])


@pytest.mark.parametrize("chunk", [2, 5, 100])
@pytest.mark.parametrize("bias", [True, False])
@CAPS
def test_per_sequence_lm_head_norms_match_a_loop(chunk, bias, softcap, temperature, backend):
    lengths = [3, 0, 7, 1, 4]  # an empty sequence, one longer than the small chunks
    n = sum(lengths)
    hidden, weight, b, targets = make(n, 6, 11, torch.float64, bias=bias, seed=7, scale=2.0)
    cap = dict(temperature=temperature, softcap=softcap)
    targets[4] = -100
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    norms = torch.full((5,), 0.5, dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=b, cu_seqlens=cu, seq_grad_sq_norm=norms,
                             chunk_size=chunk, **cap)
    (out.logp * upstream).sum().backward()
    params = [weight] + ([b] if bias else [])
    for i in range(5):
        s, e = int(cu[i]), int(cu[i + 1])
        w_i = weight.detach().clone().requires_grad_()
        b_i = b.detach().clone().requires_grad_() if bias else None
        lp = naive(hidden.detach()[s:e], w_i, targets[s:e], b_i, **cap)[0]
        want = 0.0
        if e > s:
            grads = torch.autograd.grad((lp * upstream[s:e]).sum(), [w_i] + ([b_i] if bias else []))
            want = sum(gr.pow(2).sum().item() for gr in grads)
        assert norms[i].item() == pytest.approx(0.5 + want, rel=1e-10, abs=1e-12), i  # added to what was there
    # and the summed gradient is unchanged by the per-sequence walk
    w_all = weight.detach().clone().requires_grad_()
    b_all = b.detach().clone().requires_grad_() if bias else None
    grads = torch.autograd.grad((naive(hidden.detach(), w_all, targets, b_all, **cap)[0] * upstream).sum(),
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


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_never_materialises_n_by_v(softcap, backend):
    if backend == "triton":
        pytest.skip("the Triton interpreter stages kernel arguments through host copies of their storage")
    n, h, v, chunk = 256, 8, 512, 16
    hidden, weight, bias, targets = make(n, h, v, seed=8)
    with _LargestTensor() as mode:
        out = vk.linear_logprobs(hidden, weight, targets, backend=backend, bias=bias, return_entropy=True,
                                 return_sum_p2=True, chunk_size=chunk, softcap=softcap)
        (out.logp.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
    assert mode.largest <= chunk * v < n * v  # every temporary is at most one chunk of logits


@pytest.mark.parametrize("kwargs, match", [
    ({"targets": torch.tensor([0, 99])}, "targets must be in"),
    ({"targets": torch.tensor([0.0, 1.0])}, "targets must be an int"),
    ({"hidden": torch.randn(2, 5)}, "hidden must be"),
    ({"bias": torch.randn(3)}, "bias must have shape"),
    ({"temperature": 0.0}, "temperature"),
    ({"softcap": 0.0}, "softcap"),
    ({"softcap": -30.0}, "softcap"),
    ({"softcap": float("inf")}, "softcap"),
    ({"softcap": float("nan")}, "softcap"),
    ({"softcap": True}, "softcap"),
    ({"softcap": "30"}, "softcap"),
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


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_several_blocks_per_row_with_the_maximum_last(softcap, backend):
    """V spans several of the Triton kernels' column blocks and the row maximum sits in the last one, so the
    running sums are rescaled; also the V = 1 vocabulary."""
    hidden, weight, bias, targets = make(4, 6, 9000, torch.float64, seed=10)
    with torch.no_grad():
        weight[8990:] *= 6.0  # the largest logits at the end of the row
    targets[0], targets[1] = 8995, 0
    poison_heap(4, 4 * 9000)
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, return_sum_p2=True,
                             chunk_size=3, backend=backend, softcap=softcap)
    ref = naive(hidden.detach(), weight.detach(), targets, bias.detach(), softcap=softcap)
    for got, want in zip((out.logp, out.entropy, out.sum_p2), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(out.logp.sum() + out.entropy.sum() + out.sum_p2.sum(), (hidden, weight, bias))
    want = torch.autograd.grad(sum(r.sum() for r in naive(hidden, weight, targets, bias, softcap=softcap)),
                               (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    one = vk.linear_logprobs(hidden, weight[:1], torch.zeros(4, dtype=torch.long), return_entropy=True,
                             return_sum_p2=True, backend=backend, softcap=softcap)
    # a capped logit is a product c tanh(z / c) that the compiler may fuse into logp's subtraction: an ulp off 0
    assert (one.logp.abs() <= (0 if softcap is None else 1e-15)).all()
    assert (one.entropy.abs() < 1e-12).all() and (one.sum_p2 == 1).all()


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_non_finite_hidden_gives_nan_not_a_silent_number(softcap, backend):
    hidden, weight, bias, targets = make(3, 4, 10, seed=11)
    with torch.no_grad():
        hidden[1, 2] = float("nan")
    out = vk.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, backend=backend,
                             softcap=softcap)
    assert torch.isnan(out.logp[1]) and torch.isnan(out.entropy[1])
    assert torch.isfinite(out.logp[[0, 2]]).all()


@pytest.mark.parametrize("chunk", [2, 100])
@CAPS
def test_per_sequence_gradient_rows_match_a_loop(chunk, softcap, temperature, backend):
    """seq_grad_rows[i, k] += (d W of sequence i)[seq_grad_row_ids[i, k]]: what the inner product with a tied
    embedding's per-sequence gradient needs."""
    lengths = [4, 0, 5]
    n, v, h = sum(lengths), 12, 5
    hidden, weight, b, targets = make(n, h, v, torch.float64, seed=12, scale=2.0)
    cap = dict(temperature=temperature, softcap=softcap)
    cu = torch.tensor([0, 4, 4, 9])
    ids = torch.randint(0, v, (3, 6), generator=torch.Generator().manual_seed(3))
    ids[0, 0] = ids[0, 1]  # a repeated id
    rows = torch.full((3, 6, h), 0.25, dtype=torch.float64)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = vk.linear_logprobs(hidden, weight, targets, bias=b, cu_seqlens=cu, seq_grad_row_ids=ids,
                             seq_grad_rows=rows, chunk_size=chunk, backend=backend, **cap)
    (out.logp * upstream).sum().backward()
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        w_i = weight.detach().clone().requires_grad_()
        want = torch.zeros(v, h, dtype=torch.float64)
        if e > s:
            (want,) = torch.autograd.grad((naive(hidden.detach()[s:e], w_i, targets[s:e], b.detach(), **cap)[0]
                                           * upstream[s:e]).sum(), w_i)
        torch.testing.assert_close(rows[i], 0.25 + want[ids[i]], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif("cpu" not in COMPILED_BACKENDS, reason="the C++ extension is not built")
def test_cpu_row_ops_pass_opcheck_and_reject_bad_targets():
    g = torch.Generator().manual_seed(13)
    z = torch.randn(5, 7, generator=g)
    y = torch.tensor([0, 6, -100, 3, 2])
    lse = torch.logsumexp(z, -1)
    grads = [torch.randn(5, generator=g) for _ in range(5)]
    for cap in (None, 0.7):
        torch.library.opcheck(torch.ops.vcpo.logit_rows_forward.default, (z, y, -100, cap))
        torch.library.opcheck(torch.ops.vcpo.logit_rows_backward.default, (z.clone(), lse, y, -100, *grads, 0.5, cap))
    with pytest.raises(RuntimeError, match="targets must lie in"):
        torch.ops.vcpo.logit_rows_forward(z, torch.tensor([0, 7, 0, 0, 0]), -100, None)
    with pytest.raises(RuntimeError, match="g_entropy needs"):
        torch.ops.vcpo.logit_rows_backward(z, lse, y, -100, None, grads[0], None, None, None, 1.0, None)
    for cap in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="softcap must be a finite number > 0"):
            torch.ops.vcpo.logit_rows_forward(z, y, -100, cap)
        with pytest.raises(RuntimeError, match="softcap must be a finite number > 0"):
            torch.ops.vcpo.logit_rows_backward(z.clone(), lse, y, -100, *grads, 1.0, cap)
