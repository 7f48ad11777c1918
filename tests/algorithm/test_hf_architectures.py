"""Per-sequence norms and the vcpo.step update on tiny Hugging Face causal LMs against a brute-force loop: the
families the library must handle exactly (Gemma, mixture-of-experts models), the MoE layers in the packed layout
and with transformers' default grouped_mm experts in float32, grad_norms="auto", and the architecture sweep
(tests/support/architectures.py): a representative subset by default, every causal LM of the installed transformers with
VCPO_FULL_SWEEP=1 (CI sets it)."""

import copy
import os
import warnings

import pytest
import torch

import vcpo
from vcpo.grad_norms import PerSequenceGradients, UnsupportedModuleError

transformers = pytest.importorskip("transformers")

from support import architectures  # noqa: E402
from support.backend_check import packed_lm_inputs  # noqa: E402

# Must be exact: Gemma (scaled embedding, (1 + w) norms, tied head), Gemma 2, and MoE families.
MUST_BE_EXACT = ["gemma", "gemma2", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v2"]
# Other families in the default run: dense decoders, GPT-2's Conv1D, BERT's shared decoder bias, BART's positions.
SUBSET = MUST_BE_EXACT + ["llama", "qwen3", "phi3", "gpt2", "bert", "bart", "opt"]
SWEEP = architectures.all_model_types() if os.environ.get("VCPO_FULL_SWEEP") == "1" else SUBSET


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: threads only add contention (5x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", SWEEP)
def test_architecture_never_wrong(model_type):
    """Exact, or refused with an error naming the module, or not buildable here; never a wrong number
    (check() raises architectures.Wrong)."""
    result, detail = architectures.check(model_type)
    if model_type in MUST_BE_EXACT:
        assert result == "exact", detail
    if result == "refused":
        assert detail.startswith("module '") or detail.startswith("in vcpo.step: module '"), detail


def _moe(model_type="qwen3_moe", dtype=torch.float64, experts="eager"):
    torch.manual_seed(0)
    config = architectures.tiny_config(model_type)
    config._experts_implementation = experts
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.to(dtype)


def _token_logp(logits, targets):
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _brute(objectives, params):
    return torch.stack([sum(g.double().pow(2).sum() for g in torch.autograd.grad(o, params, retain_graph=True,
                                                                                   allow_unused=True) if g is not None)
                        for o in objectives])


@pytest.mark.parametrize("ghost", [True, False])
def test_moe_padded_both_forms(ghost):
    """Each expert's norm per sequence in the ghost and the materialised form; the experts rule is used."""
    model = _moe()
    b, t = 3, 7
    ids = torch.randint(1, architectures.VOCAB, (b, t))

    def per_token():
        return _token_logp(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:])

    lp = per_token()
    want = _brute([lp[i].sum() for i in range(b)], list(model.parameters()))
    with PerSequenceGradients(model, num_seqs=b, seq_len=t, ghost=ghost) as psg:
        psg.backward(per_token().sum())
    kinds = {type(rec.module).__name__: {c.kind for c in rec.calls} for rec in psg._records}
    assert kinds["Qwen3MoeExperts"] == {"experts"} and kinds["Qwen3MoeTopKRouter"] == {"generic"}
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("ghost", [True, False, None])
def test_moe_sequences_of_unequal_shares_in_blocks(ghost, monkeypatch):
    """Eight sequences of different lengths (right padding, whose tokens receive no gradient and are left out)
    send different numbers of pairs to each expert: the experts rule pads them in several blocks of similar
    length, and every block's norms are exact."""
    from vcpo.grad_norms import experts

    blocks = []
    inner = experts._buckets
    monkeypatch.setattr(experts, "_buckets", lambda *a: blocks.append(inner(*a)[2]) or inner(*a))
    model = _moe()
    b, t = 8, 9
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, architectures.VOCAB, (b, t), generator=g)
    attention = (torch.arange(t) < torch.tensor([9, 2, 7, 5, 9, 3, 8, 4])[:, None]).long()
    keep = attention[:, 1:].double()

    def per_token():
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        return _token_logp(logits[:, :-1], ids[:, 1:]) * keep

    lp = per_token()
    want = _brute([lp[i].sum() for i in range(b)], list(model.parameters()))
    with PerSequenceGradients(model, num_seqs=b, seq_len=t, ghost=ghost) as psg:
        psg.backward(per_token().sum())
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-10, atol=0)
    assert max(len(bl) for bl in blocks) >= 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_packed(model_type):
    """Sequences packed into one row (block-diagonal causal mask, positions restarting per sequence); gpt-oss
    is refused, naming its attention."""
    model = _moe(model_type)
    lengths = torch.tensor([4, 1, 6])
    cu, ids, pos, mask, predicted = packed_lm_inputs(lengths, architectures.VOCAB)
    n = int(cu[-1])

    def per_token():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[0]
        lp = torch.zeros(n, dtype=torch.float64)
        return lp.index_put((torch.arange(1, n),), _token_logp(logits[:-1], ids[0, 1:])) * predicted

    lp = per_token()
    want = _brute([lp[int(cu[i]):int(cu[i + 1])].sum() for i in range(3)], list(model.parameters()))
    with PerSequenceGradients(model, cu_seqlens=cu) as psg:
        psg.backward(per_token().sum())
    if model_type == "gpt_oss":  # its attention has parameters (sinks) and a mask over all packed tokens
        with pytest.raises(UnsupportedModuleError, match="'model.layers.0.self_attn': replaying GptOssAttention"):
            psg.sq_norms()
        return
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-10, atol=1e-14)


def test_moe_grouped_mm_float32():
    """transformers' default experts implementation (grouped matrix products) in float32."""
    model = _moe(dtype=torch.float32, experts="grouped_mm")
    b, t = 4, 6
    ids = torch.randint(1, architectures.VOCAB, (b, t))

    def per_token():
        return _token_logp(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:])

    lp = per_token()
    want = _brute([lp[i].sum() for i in range(b)], list(model.parameters()))
    with PerSequenceGradients(model, num_seqs=b, seq_len=t) as psg:
        psg.backward(per_token().sum())
    torch.testing.assert_close(psg.sq_norms(), want, rtol=1e-4, atol=0)


class _MixingNorm(torch.nn.Module):
    """A norm that mixes the sequences of a batch: no exact per-sequence rule exists."""

    def __init__(self, inner):
        super().__init__()
        self.weight = inner.weight

    def forward(self, x):
        return self.weight * (x - x.mean(0, keepdim=True))


def test_auto_falls_back_to_the_head_norm_with_one_warning():
    torch.manual_seed(0)
    model, dtype = architectures.build("llama")
    rb = architectures.batch(dtype)
    supported = copy.deepcopy(model)
    model.model.layers[0].post_attention_layernorm = _MixingNorm(model.model.layers[0].post_attention_layernorm)
    head_only = copy.deepcopy(model)
    options = dict(ess_base_ratio=1.0, backend="torch")

    with pytest.raises(UnsupportedModuleError, match="model.layers.0.post_attention_layernorm"):
        vcpo.step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), rb,
                  vcpo.VCPOConfig(**options))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="LM head's norm.*model.layers.0.post_attention_layernorm"):
        got = vcpo.step(model, opt, rb, vcpo.VCPOConfig(grad_norms="auto", **options))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per model
        vcpo.step(model, opt, rb, vcpo.VCPOConfig(grad_norms="auto", **options))
    want = vcpo.step(head_only, torch.optim.SGD(head_only.parameters(), lr=0.1), rb,
                     vcpo.VCPOConfig(grad_norms="lm_head", **options))
    assert got["grad_sq_norm_mean"] == pytest.approx(want["grad_sq_norm_mean"], rel=1e-12)

    # a supported model: "auto" is "exact", silently
    copy_ = copy.deepcopy(supported)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = vcpo.step(supported, torch.optim.SGD(supported.parameters(), lr=0.1), rb,
                         vcpo.VCPOConfig(grad_norms="auto", **options))
    exact = vcpo.step(copy_, torch.optim.SGD(copy_.parameters(), lr=0.1), rb, vcpo.VCPOConfig(**options))
    assert auto["grad_sq_norm_mean"] == pytest.approx(exact["grad_sq_norm_mean"], rel=1e-12)
    for p, q in zip(supported.parameters(), copy_.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("model_type, softcap", [("gemma", None), ("gemma2", 0.3), ("gemma3_text", 0.3)])
def test_gemma_fused_lm_head_matches_the_checked_step(model_type, softcap):
    """Gemma's head is tied to its scaled embedding: the fused head's cross term uses the scaled embedding
    gradient; Gemma 2 and 3 cap their logits (final_logit_softcapping; a cap of 0.3 bends the tiny model's
    logits, about 1 in size, so that a fused head without it takes another step). The step must equal the
    unfused step, which test_architecture_never_wrong checks against the brute-force loop."""
    model, dtype = architectures.build(model_type)
    if softcap is not None:
        model.config.get_text_config().final_logit_softcapping = softcap
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    rb = architectures.batch(dtype)
    fused = copy.deepcopy(model)
    options = dict(ess_base_ratio=1.0, backend="torch", grad_clip=None)
    want = vcpo.step(model, torch.optim.SGD(model.parameters(), lr=1e-2), rb, vcpo.VCPOConfig(**options))
    got = vcpo.step(fused, torch.optim.SGD(fused.parameters(), lr=1e-2), rb,
                    vcpo.VCPOConfig(fused_lm_head=True, **options))
    assert got["grad_sq_norm_mean"] == pytest.approx(want["grad_sq_norm_mean"], rel=1e-10)
    for p, q in zip(fused.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
