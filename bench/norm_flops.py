"""The floor that exact per-sequence norms put under a VCPO step's time: for a causal LM's shapes and a sequence
length T, the multiply-adds per token of a plain step's forward and backward against those the norm pass adds.

A VCPO step with book-keeping runs the plain step's GEMMs once (each weight gradient assembled as B^T diag(c) A in
place of autograd's own) and adds the norm pass: each linear layer in the form vcpo.grad_norms.linear.ghost_form
picks for T (the Grams <A A^T, B B^T>, T (d_in + d_out) per token, or the materialised B^T A, d_in d_out per
token), the embedding's Gram of its output gradients over same-id positions (T d) and, for a tied head, the cross
term between its two uses (T d). So at equal GEMM efficiency, (plain + norms) / plain is the VCPO/GRPO time ratio
that no tuning of the rest can beat. Counted: every nn.Linear and nn.Embedding of the model built from its config
on the meta device, and attention's two T x T products (2 T x heads x head_dim per token and layer, no causal
saving); a backward is twice its forward. Not counted: element-wise work (RMSNorm replays, the loss), which the
profile of bench/profile_real_model_step.py measures.

    .venv/bin/python bench/norm_flops.py                          # the models below at T = 256, 1024, 4096
    .venv/bin/python bench/norm_flops.py --lengths 256 --models smollm2-135m
"""

from __future__ import annotations

import argparse

# Published shapes (the models' config.json): hidden, intermediate, layers, heads, kv heads, vocab, tied head
MODELS = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, True),  # bench_real_model.py's model
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128256, False),
}


def build(shape):
    import torch
    import transformers

    hidden, inter, layers, heads, kv, vocab, tied = shape
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      tie_word_embeddings=tied)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config), config


def count(model, config, t: int) -> dict:
    """Multiply-adds per token: the plain step's, the norm pass's, and the linear layers by form."""
    from torch import nn

    from vcpo.grad_norms.linear import ghost_form

    forward = 2 * t * config.num_attention_heads * (config.hidden_size // config.num_attention_heads) \
        * config.num_hidden_layers
    norms, forms = 0, {"ghost": 0, "materialised": 0}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            d_in, d_out = module.in_features, module.out_features
            forward += d_in * d_out
            ghost = ghost_form(t, d_in, d_out, None)
            norms += t * (d_in + d_out) if ghost else d_in * d_out
            forms["ghost" if ghost else "materialised"] += 1
        elif isinstance(module, nn.Embedding):
            norms += t * module.embedding_dim * (2 if config.tie_word_embeddings else 1)
    return {"plain": 3 * forward, "norms": norms, **forms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--lengths", default="256,1024,4096", help="sequence lengths T, comma-separated")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {list(MODELS)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    print("multiply-adds per token (M): a plain step's forward + backward, and the exact-norm pass's; "
          "floor = (plain + norms) / plain")
    print(f"{'model':15s} {'T':>6s} {'plain':>9s} {'norms':>9s} {'floor':>7s}  linear layers ghost/materialised")
    for name in names:
        model, config = build(MODELS[name])
        for t in lengths:
            c = count(model, config, t)
            print(f"{name:15s} {t:6d} {c['plain'] / 1e6:9.1f} {c['norms'] / 1e6:9.1f} "
                  f"{(c['plain'] + c['norms']) / c['plain']:7.3f}  {c['ghost']}/{c['materialised']}")


if __name__ == "__main__":
    main()
