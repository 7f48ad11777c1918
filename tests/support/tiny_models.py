"""Tiny models shared by several test files: a random tiny Llama of the built-in architecture saved as a folder, its
log-probs recomputed by a plain forward, and a float64 2-layer Llama (its shape adjustable) with a random rollout
batch for vcpo.step."""

import torch
import transformers
from torch import nn

import vcpo
from vcpo.step import token_logp
from vcpo.trainer import tiny


def save_tiny_model(folder, tokenizer=None):
    """A random tiny Llama (the built-in architecture) with `tokenizer` (default: the built-in one), saved in
    `folder`; returns its path."""
    tok = tokenizer or tiny.build_tokenizer()
    torch.manual_seed(0)
    tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def logprobs(model, prompt, ids):
    """The float32 log-probs of the tokens `ids` after `prompt` (lists of token ids) under `model`."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(prompt + ids)[1:, None])[len(prompt) - 1:, 0]


# The tiny Llama's shape; other decoder configs (Qwen2's) take the same fields.
TINY_SHAPE = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32)


def tiny_llama_config(tied=False, attention="eager", **shape):
    """The LlamaConfig of TINY_SHAPE, with the fields in `shape` replaced (a test that needs another size says so),
    tied or untied embeddings, and the attention implementation `attention`."""
    config = transformers.LlamaConfig(**{**TINY_SHAPE, **shape}, tie_word_embeddings=tied)
    config._attn_implementation = attention
    return config


def tiny_llama(seed=0, tied=False, dtype=torch.float64, attention="eager", **shape):
    """A random Llama (default: 2 layers, vocab 40, hidden 16; `shape` as in tiny_llama_config) drawn after
    torch.manual_seed(seed), in `dtype` (default float64), eval mode, eager attention unless `attention` says."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(tied, attention, **shape)).to(dtype).eval()


def rollout_batch(model, with_old=False, seed=1):
    """6 right-padded sequences of at most 10 tokens (3 of prompt) in 3 groups, behaviour log-probs 0.3 from the
    model's own (and optionally old log-probs 0.1 from them)."""
    g = torch.Generator().manual_seed(seed)
    b, t, prompt = 6, 10, 3
    ids = torch.randint(1, 40, (b, t), generator=g)
    lengths = torch.tensor([10, 7, 4, 9, 5, 10])  # right padding
    attention = (torch.arange(t) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(t) >= prompt)
    with torch.no_grad():
        current = torch.zeros(b, t, dtype=torch.float64)
        current[:, 1:] = token_logp(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
    behavior = current + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    old = current + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64) if with_old else None
    return vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 0.5]),
                             group_index=torch.tensor([0, 0, 1, 1, 2, 2]), num_groups=3, old_logp=old)


class RMSNorm(nn.Module):
    """A hand-written RMSNorm with a random scale: a module the norms replay (no rule of its own)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
