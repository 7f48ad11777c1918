"""The check that a replayed module reproduces its output runs once per module, way of replay and key
(vcpo/grad_norms/records.py, replay_key), not on every step: the numbers are bit-identical to those of a step that
checks every replay, and a module whose replay would differ is still refused (random in train mode, switched to
train mode after a check in eval mode, mixing the sequences of a batch), docs/grad_norms.md."""

import copy
import gc
import random
import weakref

import pytest
import torch
from torch import nn

import vcpo
from support.tiny_models import RMSNorm
from vcpo.grad_norms import PerSequenceGradients, UnsupportedModuleError, records, replay


@pytest.fixture(autouse=True)
def _fresh_checks():
    """Each test starts as a process's first step does (the cache is per process)."""
    records.forget_replay_checks()
    yield
    records.forget_replay_checks()


@pytest.fixture
def checks(monkeypatch):
    """Counts the checks the replays run (replay.replay_matches, read by per_seq and weighted)."""
    count = [0]
    inner = replay.replay_matches

    def counted(*args):
        count[0] += 1
        return inner(*args)

    monkeypatch.setattr(replay, "replay_matches", counted)
    return count


class PythonNoise(nn.Module):
    """Train-mode noise drawn from Python's random module: vmap does not see it (torch's random ops raise under
    vmap and send the replay to the per-sequence loop), only the check does."""

    def forward(self, x):
        return x * (1 + random.random()) if self.training else x


class Noisy(nn.Module):
    """A module with parameters that calls a random child (nn.Dropout or PythonNoise) in train mode."""

    def __init__(self, d, noise):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.noise = noise

    def forward(self, x):
        return self.noise(self.weight * x)


class MixesSequences(nn.Module):
    """Subtracts half the batch's mean: no exact per-sequence rule exists."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * (x - 0.5 * x.mean(0, keepdim=True))


class Net(nn.Module):
    """Token-wise (no attention, so packed sequences stay apart): two replayed norms around `mid` (replayed too)."""

    def __init__(self, mid=None, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.mid = mid if mid is not None else RMSNorm(d)
        self.up = nn.Linear(d, d)
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.up(self.mid(self.ln(self.emb(ids)))))))


def _batch(layout, b=3, t=5, seed=0, same=False):
    """(ids, targets, PerSequenceGradients layout keywords, per-sequence objectives of the token log-probs)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        ids, targets = torch.randint(0, 11, (b, t), generator=g), torch.randint(0, 11, (b, t), generator=g)
        if same:
            ids, targets = ids[:1].expand(b, t), targets[:1].expand(b, t)
        return ids, targets, dict(num_seqs=b), lambda lp: [lp[i].sum() for i in range(b)]
    cu = torch.tensor([0, 4, 5, 9])
    ids, targets = torch.randint(0, 11, (1, 9), generator=g), torch.randint(0, 11, (1, 9), generator=g)
    return ids, targets, dict(cu_seqlens=cu), lambda lp: [lp[0, int(cu[i]):int(cu[i + 1])].sum() for i in range(3)]


def _one_pass(model, layout, seed=0, **batch):
    """A norm pass and book-keeping on one batch: (norms, the assembled gradient of every parameter)."""
    ids, targets, kw, objectives = _batch(layout, seed=seed, **batch)
    with PerSequenceGradients(model, **kw) as psg:
        lp = torch.log_softmax(model(ids), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        psg.backward(sum(objectives(lp)))
    norms = psg.sq_norms()
    for p in model.parameters():
        p.grad = None
    psg.assemble(torch.linspace(-1.0, 2.0, norms.numel(), dtype=torch.float64))
    return norms, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_checked_once_with_the_numbers_of_a_check_on_every_step(layout, checks):
    """Three passes with an SGD step between them: the first checks every replay (vmap and whole call), the later
    ones none, and norms and gradients equal, bit for bit, those of a twin whose every replay is checked."""
    torch.manual_seed(0)
    model = Net().double()
    twin = copy.deepcopy(model)
    got, counts = [], []
    for step in range(3):
        before = checks[0]
        got.append(_one_pass(model, layout, seed=step))
        counts.append(checks[0] - before)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    assert counts[0] == 2 * 3 and counts[1:] == [0, 0]  # ln, mid, norm: per_seq's vmap and the whole call
    for step in range(3):
        records.forget_replay_checks()  # the twin checks every replay, as before the cache
        before = checks[0]
        norms, grads = _one_pass(twin, layout, seed=step)
        assert checks[0] - before == 2 * 3
        assert torch.equal(norms, got[step][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, got[step][1]))
        with torch.no_grad():
            for p in twin.parameters():
                p -= 0.1 * p.grad


def test_vcpo_step_checked_once_is_bit_identical(checks):
    """Two vcpo.step updates of a tiny Llama (its RMSNorms are replayed): the second checks nothing, and the
    weights and metrics equal those of a twin that checks every replay on every step."""
    pytest.importorskip("transformers")
    from support import architectures
    model, dtype = architectures.build("llama")
    rb = architectures.batch(dtype)
    twin = copy.deepcopy(model)
    config = vcpo.VCPOConfig(ess_base_ratio=1.0, backend="torch")
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    vcpo.step(model, opt, rb, config)
    before = checks[0]
    got = vcpo.step(model, opt, rb, config)
    assert checks[0] == before
    for _ in range(2):
        records.forget_replay_checks()
        want = vcpo.step(twin, twin_opt, rb, config)
    assert checks[0] > before
    assert got == want
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_dropout_in_train_mode_is_refused_on_its_first_step(layout):
    torch.manual_seed(1)
    model = Net(Noisy(6, nn.Dropout(0.5))).double().train()
    with pytest.raises(UnsupportedModuleError, match="'mid'.*does not reproduce its output"):
        _one_pass(model, layout)
    ids, targets, kw, objectives = _batch(layout)
    with PerSequenceGradients(model, **kw) as psg:  # book-keeping alone (no norms first) refuses it too
        psg.backward(model(ids).sum())
    with pytest.raises(UnsupportedModuleError, match="'mid'.*does not reproduce its output"):
        psg.assemble(torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("noise", ["dropout", "python"])
@pytest.mark.parametrize("switch", ["model", "child"])
def test_checked_in_eval_mode_then_switched_to_train_mode_is_refused(noise, switch, checks):
    """Checked (and remembered) in eval mode, then switched to train mode, the whole model or only the random child
    the replayed module calls: refused on the first step after the switch, by the norms and by book-keeping."""
    torch.manual_seed(2)
    model = Net(Noisy(6, nn.Dropout(0.5) if noise == "dropout" else PythonNoise())).double().eval()
    _one_pass(model, "padded")
    before = checks[0]
    _one_pass(model, "padded", seed=1)
    assert checks[0] == before  # remembered
    (model if switch == "model" else model.mid.noise).train()
    with pytest.raises(UnsupportedModuleError, match="'mid'.*does not reproduce its output"):
        _one_pass(model, "padded", seed=2)
    ids, _, kw, _ = _batch("padded", seed=3)
    with PerSequenceGradients(model, **kw) as psg:
        psg.backward(model(ids).sum())
    with pytest.raises(UnsupportedModuleError, match="'mid'.*does not reproduce its output"):
        psg.assemble(torch.ones(3, dtype=torch.float64))
    model.eval()  # back to the key that passed: not checked again
    before = checks[0]
    _one_pass(model, "padded", seed=4)
    assert checks[0] == before


@pytest.mark.parametrize("first", [None, "one sequence", "identical sequences"])
def test_a_module_that_mixes_sequences_is_refused(first):
    """Refused on its first step; a first batch that cannot tell sequences apart (one sequence, or identical ones)
    passes the check but is not remembered, so the next batch is checked and refused."""
    torch.manual_seed(3)
    model = Net(MixesSequences(6)).double()
    if first == "one sequence":
        _one_pass(model, "padded", b=1)
    elif first == "identical sequences":  # two: their mean is exact, so the replay matches to the last bit
        _one_pass(model, "padded", b=2, same=True)
    with pytest.raises(UnsupportedModuleError, match="'mid'.*does not reproduce its output"):
        _one_pass(model, "padded", seed=5)


def test_the_cache_does_not_keep_a_module_alive():
    model = Net().double()
    _one_pass(model, "padded")
    assert len(records._PASSED) == 3
    ref = weakref.ref(model.mid)
    del model
    gc.collect()
    assert ref() is None and len(records._PASSED) == 0


def _tiny_moe(experts_class=None):
    transformers = pytest.importorskip("transformers")
    from support import architectures
    torch.manual_seed(0)
    config = architectures.tiny_config("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_config(config).eval().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if experts_class is not None:
        for layer in model.model.layers:
            layer.mlp.experts.__class__ = experts_class
    return model


def _moe_pass(model, seed):
    """A norm pass of the tiny MoE on 3 sequences: (norms, the assembled gradient of every parameter)."""
    from support import architectures
    ids = torch.randint(1, architectures.VOCAB, (3, 7), generator=torch.Generator().manual_seed(seed))
    with PerSequenceGradients(model, num_seqs=3, seq_len=7) as psg:
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1], -1)
        psg.backward(lp.gather(-1, ids[:, 1:, None]).sum())
    norms = psg.sq_norms()
    for p in model.parameters():
        p.grad = None
    psg.assemble(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    return norms, [p.grad.clone() for p in model.parameters()]


def test_experts_checked_once_per_implementation_with_the_same_numbers(monkeypatch):
    """The experts rule's recomputed output is checked on the first pass of each experts layer (2 layers) and again
    when the experts implementation changes; the numbers equal, bit for bit, those of a twin checked every pass."""
    from vcpo.grad_norms import experts
    count = [0]
    inner = experts.replay_matches
    monkeypatch.setattr(experts, "replay_matches", lambda *a: count.__setitem__(0, count[0] + 1) or inner(*a))
    model = _tiny_moe()
    twin = copy.deepcopy(model)
    counts, got = [], []
    for seed in range(3):
        before = count[0]
        got.append(_moe_pass(model, seed))
        counts.append(count[0] - before)
    assert counts == [2, 0, 0]
    for seed in range(3):
        records.forget_replay_checks()
        want = _moe_pass(twin, seed)
        assert torch.equal(want[0], got[seed][0]) and all(torch.equal(a, b) for a, b in zip(want[1], got[seed][1]))
    model.config._experts_implementation = "batched_mm"
    before = count[0]
    _moe_pass(model, 0)
    assert count[0] - before == 2


def test_experts_that_compute_something_else_are_refused_on_every_pass():
    """An experts class on transformers' dispatcher whose own forward scales the standard output: the recomputed
    output differs, so the rule refuses it, and a refusal is never remembered as a pass."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class ScaledExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 1.5 * Qwen3MoeExperts.forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)

    ScaledExperts.__module__ = "transformers.models.scaled"  # the rule is for transformers' experts classes only
    model = _tiny_moe(use_experts_implementation(ScaledExperts))
    for seed in range(2):
        with pytest.raises(UnsupportedModuleError, match="'model.layers.0.mlp.experts'.*standard routed experts"):
            _moe_pass(model, seed)
