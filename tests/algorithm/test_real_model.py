"""SmolLM2-135M-Instruct, a real pretrained model (tests/support/real_model.py), converted from its GGUF file by
`--model PATH.gguf`'s path: the chat template and default system prompt as the tokenizer and vcpo's PromptFormat
render them; exact per-sequence squared gradient norms (vcpo.PerSequenceGradients, one batched backward) against one
backward per sequence, in float64, with Hugging Face gradient checkpointing off and on (reentrant and not); and one
vcpo.step with non-reentrant checkpointing against the step without it (reentrant checkpointing is refused by
name: the norm pass's backward to the recorded layers cannot pass through it)."""

import copy

import pytest
import torch

import vcpo
from support.real_model import SYSTEM_PROMPT, smollm2_folder
from vcpo.grad_norms import PerSequenceGradients
from vcpo.step import token_logp

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # loads a real pretrained model

PROMPTS = ["What is 23 + 19?", "Name a prime number.", "Say hi."]
RESPONSES = ["23 + 19 = 42.", "Seven is prime: it has no divisor but 1 and itself.", "Hi!"]


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


@pytest.fixture(scope="module")
def tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def batch(tokenizer):
    """The three chats as right-padded ids, the response tokens counted (the prompt and padding not)."""
    rows, prompt_lengths = [], []
    for prompt, response in zip(PROMPTS, RESPONSES):
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + tokenizer(response, add_special_tokens=False)["input_ids"])
        prompt_lengths.append(len(prompt_ids))
    t = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id or 0] * (t - len(r)) for r in rows])
    positions = torch.arange(t)
    attention = (positions < torch.tensor([len(r) for r in rows])[:, None]).long()
    loss_mask = attention * (positions >= torch.tensor(prompt_lengths)[:, None])
    return ids, attention, loss_mask


def test_chat_template_renders_the_default_system_prompt(folder, tokenizer):
    from vcpo.trainer.data import PromptFormat

    messages = [{"role": "user", "content": PROMPTS[0]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    rendered = PromptFormat(tokenizer).text(PROMPTS[0])
    assert rendered == text
    ids = PromptFormat(tokenizer).ids(rendered)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # no second BOS or system prompt: the template writes them once


def _model(folder, checkpointing=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    if checkpointing is None:
        model.eval()
    else:  # Hugging Face checkpoints only in training mode (SmolLM2 has no dropout: the same forward)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.train()
    return model


def _logp(model, batch):
    ids, attention, loss_mask = batch
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    return token_logp(logits, ids[:, 1:]) * loss_mask[:, 1:]


@pytest.fixture(scope="module")
def brute_force(folder, batch):
    """||d sum_t logp_t / d theta||^2 of each sequence, one backward each, without checkpointing."""
    model = _model(folder)
    params = [p for p in model.parameters() if p.requires_grad]
    per_token = _logp(model, batch)
    norms = []
    for i in range(per_token.shape[0]):
        grads = torch.autograd.grad(per_token[i].sum(), params, retain_graph=True)
        norms.append(sum(g.pow(2).sum() for g in grads))
    return torch.stack(norms)


@pytest.mark.parametrize("checkpointing", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_exact_norms_on_the_real_model_match_a_backward_per_sequence(folder, batch, brute_force, checkpointing):
    model = _model(folder, checkpointing)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied: the cross term
    with PerSequenceGradients(model, num_seqs=len(PROMPTS)) as psg:
        _logp(model, batch).sum().backward()
    assert torch.all(brute_force > 0)
    torch.testing.assert_close(psg.sq_norms(), brute_force, rtol=1e-9, atol=0)


@pytest.fixture(scope="module")
def rollouts(folder, batch):
    ids, attention, loss_mask = batch
    noise = 0.05 * torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64)
    with torch.no_grad():
        behaviour = torch.zeros(ids.shape, dtype=torch.float64)
        behaviour[:, 1:] = _logp(_model(folder), batch) + noise
    return vcpo.RolloutBatch(ids, attention, loss_mask, behaviour, torch.tensor([1.0, 0.0, 0.5]),
                             group_index=torch.tensor([0, 0, 0]), num_groups=1)


def _step(model, rollouts):
    before = copy.deepcopy([p.detach() for p in model.parameters()])
    metrics = vcpo.step(model, torch.optim.SGD(model.parameters(), lr=1e-3), rollouts, vcpo.VCPOConfig(grad_clip=None))
    return [p.detach() - b for p, b in zip(model.parameters(), before)], metrics


def test_a_step_with_non_reentrant_checkpointing_is_the_step_without(folder, rollouts):
    plain, plain_metrics = _step(_model(folder), rollouts)
    update, metrics = _step(_model(folder, checkpointing=False), rollouts)
    assert plain_metrics["grad_norm"] > 0 and 0 < plain_metrics["lr_scale"] <= 1
    for key in ("loss", "ess_ratio", "lr_scale", "grad_norm", "grad_sq_norm_mean", "baseline_mean"):
        assert metrics[key] == pytest.approx(plain_metrics[key], rel=1e-9, abs=1e-12), key
    for a, b in zip(update, plain):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-14)


def test_reentrant_checkpointing_is_refused_with_the_fix(folder, rollouts):
    """vcpo.step's norm pass backpropagates to the recorded layers only (torch.autograd.grad), which a reentrant
    checkpoint cannot do: a clear error before any weight moves, instead of torch's RuntimeError mid-step."""
    model = _model(folder, checkpointing=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="use_reentrant': False"):
        vcpo.step(model, torch.optim.SGD(model.parameters(), lr=1e-3), rollouts, vcpo.VCPOConfig(grad_clip=None))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
