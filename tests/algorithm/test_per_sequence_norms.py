"""Per-sequence squared gradient norms from one backward against a brute-force loop (one backward per
sequence, then the norm), in float64, on small models with every supported layer kind and on tiny random
Hugging Face causal LMs (Llama, Qwen2 tied and untied, GPT-2)."""

import pytest
import torch
from torch import nn

from support.backend_check import packed_lm_inputs
from support.tiny_models import RMSNorm
from vcpo.grad_norms import PerSequenceGradients, UnsupportedModuleError


def brute_force(objectives, params):
    """||d objective_i / d params||^2 for each sequence, one backward each."""
    out = []
    for obj in objectives:
        grads = torch.autograd.grad(obj, params, retain_graph=True, allow_unused=True)
        out.append(sum(g.double().pow(2).sum() for g in grads if g is not None))
    return torch.stack(out)


class TokenwiseLM(nn.Module):
    """No attention, so packed sequences stay independent: embeddings (token and position, one with a
    padding index), LayerNorm, RMSNorm, linear layers with and without bias, a tied LM head."""

    def __init__(self, vocab=11, d=6, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(40, d)
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids, pos):
        h = self.tok(ids) + self.pos(pos)
        h = h + self.down(torch.tanh(self.up(self.ln(h))))
        return self.head(self.norm(h))


def _token_logp(logits, targets):
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ghost", [None, True, False])
def test_padded_tokenwise_model(tied, ghost):
    torch.manual_seed(0)
    model = TokenwiseLM(tied=tied).double()
    b, t = 5, 9
    ids = torch.randint(0, 11, (b, t))  # includes the padding index 0
    targets = torch.randint(0, 11, (b, t))
    mask = torch.rand(b, t) < 0.8
    mask[1] = False
    mask[1, 0] = True  # a one-token sequence
    pos = torch.arange(t).expand(b, t)
    params = [p for p in model.parameters()]
    logp = _token_logp(model(ids, pos), targets)
    want = brute_force([(logp[i] * mask[i]).sum() for i in range(b)], params)
    with PerSequenceGradients(model, num_seqs=b, ghost=ghost) as psg:
        logp = _token_logp(model(ids, pos), targets)
        (logp * mask).sum().backward()
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_tokenwise_model(tied):
    torch.manual_seed(1)
    model = TokenwiseLM(tied=tied).double()
    lengths = torch.tensor([4, 1, 7, 3])
    cu = torch.zeros(5, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    ids = torch.randint(0, 11, (1, n))
    targets = torch.randint(0, 11, (1, n))
    pos = torch.cat([torch.arange(int(k)) for k in lengths]).unsqueeze(0)
    params = list(model.parameters())
    logp = _token_logp(model(ids, pos), targets)[0]
    want = brute_force([logp[int(cu[i]):int(cu[i + 1])].sum() for i in range(4)], params)
    with PerSequenceGradients(model, cu_seqlens=cu) as psg:
        _token_logp(model(ids, pos), targets).sum().backward()
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-9, atol=1e-12)


def _hf_models():
    transformers = pytest.importorskip("transformers")
    from support.tiny_models import TINY_SHAPE, tiny_llama_config

    small = {**TINY_SHAPE, "vocab_size": 48}
    return {
        "llama": tiny_llama_config(vocab_size=48),
        "qwen2-untied": transformers.Qwen2Config(**small, tie_word_embeddings=False),
        "qwen2-tied": transformers.Qwen2Config(**small, tie_word_embeddings=True),
        "gpt2": transformers.GPT2Config(vocab_size=48, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                        bos_token_id=0, eos_token_id=0),
    }


@pytest.mark.parametrize("name", ["llama", "qwen2-untied", "qwen2-tied", "gpt2"])
def test_hugging_face_causal_lms_padded(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    config = _hf_models()[name]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()  # no dropout: same forwards
    if name == "qwen2-tied":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    b, t = 4, 10
    ids = torch.randint(1, 48, (b, t))
    lengths = torch.tensor([10, 6, 1, 8])  # right padding; one sequence of one token
    attention = (torch.arange(t) < lengths[:, None]).long()
    response = attention.bool() & (torch.arange(t) >= 2)  # the first two tokens: the prompt
    params = [p for p in model.parameters() if p.requires_grad]

    def objective():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logp = _token_logp(logits, ids[:, 1:])
        return logp * response[:, 1:]

    per_token = objective()
    want = brute_force([per_token[i].sum() for i in range(b)], params)
    with PerSequenceGradients(model, num_seqs=b) as psg:
        objective().sum().backward()
    got = psg.sq_norms()
    assert torch.all(want[lengths > 2] > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-10)


def test_layout_errors():
    model = TokenwiseLM()
    with pytest.raises(ValueError, match="num_seqs"):
        PerSequenceGradients(model)
    with pytest.raises(ValueError, match="num_seqs"):
        PerSequenceGradients(model, num_seqs=2, cu_seqlens=torch.tensor([0, 1, 2]))
    with PerSequenceGradients(model, num_seqs=3) as psg:
        ids = torch.randint(0, 11, (2, 4))
        model(ids, torch.arange(4).expand(2, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"shape \(2, 4\), not laid out by sequence"):
        psg.sq_norms()


def _assemble_vs_brute(model, forward, objectives_fn, layout_kw, b):
    """assemble(c) after the recorded backward of sum_i objective_i must equal sum_i c_i g_i, with g_i from one
    backward per sequence (the brute-force loop)."""
    params = [p for p in model.parameters() if p.requires_grad]
    c = torch.randn(b, dtype=torch.float64)
    per_seq = objectives_fn(forward())
    want = [torch.zeros_like(p) for p in params]
    for i in range(b):
        for w, g in zip(want, torch.autograd.grad(per_seq[i], params, retain_graph=True, allow_unused=True)):
            if g is not None:
                w += c[i] * g
    with PerSequenceGradients(model, **layout_kw) as psg:
        sum(objectives_fn(forward())).backward()
    for p in params:
        p.grad = None
    psg.assemble(c)
    for p, w in zip(params, want):
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_assemble_tokenwise_model(tied, layout):
    torch.manual_seed(3)
    model = TokenwiseLM(tied=tied).double()
    if layout == "padded":
        b, t = 4, 7
        ids, targets = torch.randint(0, 11, (b, t)), torch.randint(0, 11, (b, t))
        pos = torch.arange(t).expand(b, t)
        mask = torch.rand(b, t) < 0.8

        def objectives(logp):
            return [(logp[i] * mask[i]).sum() for i in range(b)]
        layout_kw = dict(num_seqs=b)
    else:
        lengths = torch.tensor([3, 1, 5, 2])
        b = 4
        cu = torch.zeros(5, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        n = int(cu[-1])
        ids, targets = torch.randint(0, 11, (1, n)), torch.randint(0, 11, (1, n))
        pos = torch.cat([torch.arange(int(k)) for k in lengths]).unsqueeze(0)

        def objectives(logp):
            return [logp[0, int(cu[i]):int(cu[i + 1])].sum() for i in range(b)]
        layout_kw = dict(cu_seqlens=cu)
    _assemble_vs_brute(model, lambda: _token_logp(model(ids, pos), targets), objectives, layout_kw, b)


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gpt2"])
def test_assemble_hugging_face(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    config = _hf_models()[name]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    b, t = 3, 8
    ids = torch.randint(1, 48, (b, t))
    attention = (torch.arange(t) < torch.tensor([8, 5, 2])[:, None]).long()

    def forward():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        return _token_logp(logits, ids[:, 1:]) * attention[:, 1:]

    _assemble_vs_brute(model, forward, lambda lp: [lp[i].sum() for i in range(b)], dict(num_seqs=b), b)


def test_recorder_backward_records_the_same_and_skips_parameter_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = _hf_models()["gpt2"]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    ids = torch.randint(1, 48, (3, 7))
    results = []
    for own_backward, freeze in ((False, False), (True, False), (True, True)):
        model.zero_grad(set_to_none=True)
        with PerSequenceGradients(model, num_seqs=3, freeze_parameters=freeze) as psg:
            objective = _token_logp(model(input_ids=ids).logits[:, :-1], ids[:, 1:]).sum()
            psg.backward(objective) if own_backward else objective.backward()
            if freeze:
                with pytest.raises(ValueError, match="frozen"):
                    psg.sq_norms()
        assert any(p.grad is not None for p in model.parameters()) != own_backward
        assert all(p.requires_grad for p in model.parameters())  # restored on leaving the block
        c = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        psg.assemble(c)
        results.append((psg.sq_norms(), [p.grad.clone() for p in model.parameters()]))
        psg.release()
        assert psg.sq_norms().abs().sum() == 0  # released: nothing recorded any more
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], rtol=1e-12, atol=0)
        for a, b in zip(results[0][1], other[1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("freeze", [False, True])
def test_checkpointed_layers_are_recorded_once_with_the_same_norms_and_gradient(freeze):
    """Non-reentrant activation checkpointing recomputes each segment in the backward; the gradients flow through
    the first forward's graph, so only its calls are recorded: one call per module, not a second set holding every
    segment's inputs again (what made a checkpointed step's peak 5.7x a plain one's on SmolLM2). Norms and gradient
    as without checkpointing."""
    from support.tiny_models import tiny_llama

    ids = torch.randint(1, 40, (3, 9), generator=torch.Generator().manual_seed(2))
    c = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    results = []
    for checkpointing in (False, True):
        model = tiny_llama(seed=3)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # Hugging Face checkpoints in training mode only (no dropout in this config)
        with PerSequenceGradients(model, num_seqs=3, freeze_parameters=freeze) as psg:
            objective = _token_logp(model(input_ids=ids).logits[:, :-1], ids[:, 1:]).sum()
            psg.backward(objective)
        assert [len(r.calls) for r in psg._records] == [1] * len(psg._records)
        model.zero_grad(set_to_none=True)
        psg.assemble(c)
        results.append((psg.sq_norms(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=0)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


class _Wide(nn.Module):
    """Linear layers fed [B, d] and [B, T, H, d] activations, with bias."""

    def __init__(self):
        super().__init__()
        self.per_sequence = nn.Linear(4, 4)
        self.per_head = nn.Linear(4, 4)

    def forward(self, x):  # x [B, T, H, 4]
        pooled = self.per_sequence(x.mean((1, 2)))  # [B, 4]
        return (self.per_head(x) * pooled[:, None, None, :]).sum((1, 2, 3))


@pytest.mark.parametrize("ghost", [None, True, False])
def test_linear_inputs_of_any_rank(ghost):
    torch.manual_seed(7)
    model = _Wide().double()
    x = torch.randn(3, 5, 2, 4, dtype=torch.float64)
    out = model(x)
    want = brute_force([out[i] for i in range(3)], list(model.parameters()))
    with PerSequenceGradients(model, num_seqs=3, ghost=ghost) as psg:
        model(x).sum().backward()
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-10, atol=1e-12)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x, y, scale=1.0):
        return self.w * x + scale * y * self.w.pow(2)


class _Router(nn.Module):
    """Returns its logits and scores computed from them (a router's tuple): only the gradient reaching each
    output from outside may be replayed through it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        return logits, torch.softmax(logits, -1), logits.argmax(-1)


class _ScaledEmbedding(nn.Embedding):
    """Not registered: its forward is not nn.Embedding's, so it must not get the plain embedding's rule."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class _ShiftedLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x + 1.0)


class _ManyKinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = _ScaledEmbedding(11, 3)
        self.pair = _TwoInputs()
        self.router = _Router()
        self.lin = _ShiftedLinear(4, 11)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.pair(h, torch.tanh(h), scale=0.5)
        logits, scores, _ = self.router(h)
        return self.lin(logits * scores + logits)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_modules_without_a_closed_form_are_replayed_exactly(layout):
    """Keyword and several tensor arguments, tuple outputs used inside the module, subclasses of nn.Embedding
    and nn.Linear with another forward: norms and assembled gradient against the brute-force loop."""
    torch.manual_seed(8)
    model = _ManyKinds().double()
    if layout == "padded":
        ids, targets = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
        kw, b = dict(num_seqs=3), 3

        def objectives(lp):
            return [lp[i].sum() for i in range(b)]
    else:
        cu = torch.tensor([0, 4, 5, 9])
        ids, targets = torch.randint(0, 11, (1, 9)), torch.randint(0, 11, (1, 9))
        kw, b = dict(cu_seqlens=cu), 3

        def objectives(lp):
            return [lp[0, int(cu[i]):int(cu[i + 1])].sum() for i in range(b)]

    def forward():
        return _token_logp(model(ids), targets)

    want = brute_force(objectives(forward()), list(model.parameters()))
    with PerSequenceGradients(model, **kw) as psg:
        psg.backward(sum(objectives(forward())))
    assert all(call.kind == "generic" for rec in psg._records for call in rec.calls)
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-10, atol=1e-12)
    _assemble_vs_brute(model, forward, objectives, kw, b)


def test_refusals_name_the_module():
    class OutsideUse(nn.Module):
        """Uses the embedding's weight outside the embedding's forward: that gradient would be missed."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)

        def forward(self, ids):
            return torch.nn.functional.linear(self.emb(ids), self.emb.weight)

    class MixesSequences(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.w * x + (self.w * x).mean(0)

    class Net(nn.Module):
        def __init__(self, embedding):
            super().__init__()
            self.emb = embedding
            self.mix = MixesSequences()

        def forward(self, ids):
            return self.mix(self.emb(ids))

    ids = torch.randint(0, 5, (2, 4))
    model = OutsideUse()
    with pytest.raises(UnsupportedModuleError, match=r"module 'emb'.*'emb.weight' is used by 'linear' outside"):
        with PerSequenceGradients(model, num_seqs=2) as psg:
            psg.backward(model(ids).sum())
    net = Net(nn.Embedding(5, 3)).double()
    with PerSequenceGradients(net, num_seqs=2) as psg:
        psg.backward(net(ids).sum())
    with pytest.raises(UnsupportedModuleError, match="'mix'.*does not reproduce its output"):
        psg.sq_norms()

    class InPlace(nn.Module):
        """Modifies a linear layer's input after the call: with frozen parameters autograd keeps no copy to
        complain about, and the kept input would no longer be what the layer saw."""

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            h = torch.tanh(x)
            y = self.a(h)
            h.mul_(2.0)
            return y + h

    inplace = InPlace().double()
    with PerSequenceGradients(inplace, num_seqs=2, freeze_parameters=True) as psg:
        psg.backward(inplace(torch.randn(2, 4, 3, dtype=torch.float64)).sum())
    with pytest.raises(UnsupportedModuleError, match="'a'.*modified in place"):
        psg.sq_norms()
    for flags in (dict(scale_grad_by_freq=True), dict(sparse=True)):
        with pytest.raises(UnsupportedModuleError, match="'emb'.*scale_grad_by_freq"):
            with PerSequenceGradients(Net(nn.Embedding(5, 3, **flags)), num_seqs=2):
                pass


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gpt2"])
def test_hugging_face_causal_lms_packed(name):
    """Sequences packed into one row, kept apart by a block-diagonal causal 4-D attention mask and
    position ids that restart at each sequence."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    config = _hf_models()[name]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    lengths = torch.tensor([5, 1, 7, 3])
    cu, ids, pos, mask, predicted = packed_lm_inputs(lengths, 48)
    n = int(cu[-1])

    def per_token():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0]
        lp = torch.zeros(n, dtype=torch.float64)
        return lp.index_put((torch.arange(1, n),), _token_logp(logits[:-1], ids[0, 1:])) * predicted

    params = [p for p in model.parameters() if p.requires_grad]
    lp = per_token()
    want = brute_force([lp[int(cu[i]):int(cu[i + 1])].sum() for i in range(4)], params)
    with PerSequenceGradients(model, cu_seqlens=cu) as psg:
        per_token().sum().backward()
    assert want[1] == 0 and torch.all(want[[0, 2, 3]] > 0)  # a one-token sequence predicts nothing
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-6, atol=1e-10)

@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ghost", [None, True, False])
def test_forms_follow_the_cost_rule(tied, ghost, monkeypatch):
    # T = 4: up (6 -> 12) and down (12 -> 6) sit on the rule's boundary, 4 (6 + 12) = 6 x 12, so ghost; the
    # untied head (6 -> 11): 4 x 17 > 66, materialised. The documented rule, written out here.
    torch.manual_seed(0)
    model = TokenwiseLM(tied=tied).double()
    b, t = 3, 4
    ids, targets = torch.randint(0, 11, (b, t)), torch.randint(0, 11, (b, t))
    pos = torch.arange(t).expand(b, t)
    shapes = {"up": (6, 12), "down": (12, 6), "head": (6, 11)}
    rule = {n: ghost if ghost is not None else t * (i + o) <= i * o for n, (i, o) in shapes.items()}
    want = {"tok": "same-token", "pos": "same-token", "ln": "replayed", "norm": "replayed",
            **{n: "ghost" if g else "materialised" for n, g in rule.items()}}
    logp = _token_logp(model(ids, pos), targets)
    ref = brute_force([logp[i].sum() for i in range(b)], list(model.parameters()))
    with PerSequenceGradients(model, num_seqs=b, ghost=ghost) as psg:
        _token_logp(model(ids, pos), targets).sum().backward()
    assert dict(psg.forms()) == want and len(psg.forms()) == len(want)
    # sq_norms takes those forms: a ghost weight forms [T, T] Gram matrices, a materialised one [d_out, d_in].
    products = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda x, y: products.append(tuple(bmm(x, y).shape[1:])) or bmm(x, y))
    got = psg.sq_norms()
    monkeypatch.undo()
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    materialised = {(o, i) for n, (i, o) in shapes.items() if not rule[n]}
    assert {s for s in products if s != (t, t)} == materialised
    if not tied:  # tied, the head's cross term with the embedding forms [T, T] products of its own
        assert products.count((t, t)) == 2 * sum(rule.values()) + 2  # + one per embedding (same-token)
