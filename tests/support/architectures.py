"""The architecture sweep: every causal LM of the installed transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) built
with a tiny random config, its per-sequence squared gradient norms (PerSequenceGradients) and one vcpo.step update
compared with a brute-force loop (one backward per sequence), in float64 where the model runs in it.

    python tests/support/architectures.py [model_type ...]    # prints the markdown table of docs/grad_norms.md
"""

from __future__ import annotations

import copy
import sys
import time
import warnings

import torch

B, T, PROMPT = 3, 7, 2  # B and T coprime: a layout that mixes sequences and tokens cannot pass by chance
VOCAB = 64
MAX_PARAMS = 2_000_000
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=64, moe_intermediate_size=8, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    shared_expert_intermediate_size=8,
    n_embd=16, n_layer=2, n_head=2, n_positions=64, d_model=16, n_layers=2, n_heads=2, d_ff=24, ffn_dim=24,
    decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=24, num_layers=2, embed_dim=16, kv_lora_rank=8,
    q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1,
    topk_group=1, dense_intermediate_size=24, rotary_dim=4,
)


class Wrong(AssertionError):
    """A per-sequence norm or update that differs from the brute-force loop: never acceptable."""


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    sizes = {k: v for k, v in _SIZES.items() if hasattr(default, k)}
    if hasattr(default, "qk_rope_head_dim"):  # multi-head latent attention: head_dim is the rotary part
        sizes.pop("head_dim", None)
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    config = cls(**sizes)
    for name in ("text_config", "decoder"):  # composite configs: shrink the language model too
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_default = type(sub)()
            setattr(config, name, type(sub)(**{k: v for k, v in _SIZES.items() if hasattr(sub_default, k)}))
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel on the CPU
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, attr, None), int) and getattr(config, attr) >= VOCAB:
            setattr(config, attr, 0)
    return config


def build(model_type: str):
    """(model, dtype) or raises: float64 where the model's forward runs in it, else float32."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    del MODEL_FOR_CAUSAL_LM_MAPPING
    torch.manual_seed(0)
    config = tiny_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):  # sizes the shrunk config leaves large are found without allocating them
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {size / 1e6:.1f}M parameters (sizes not shrunk)")
        model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():  # zero-initialised weights (routers, norms) would hide a wrong rule
        with torch.no_grad():
            p.add_(0.05 * torch.randn_like(p))
    for dtype in (torch.float64, torch.float32):
        m = copy.deepcopy(model).to(dtype)
        try:
            with torch.no_grad():
                m(input_ids=torch.ones(1, 3, dtype=torch.long), use_cache=False)
            return m, dtype
        except Exception:
            if dtype == torch.float32:
                raise
    raise AssertionError("unreachable")


def batch(dtype):
    import vcpo
    from vcpo.step import token_logp  # noqa: F401

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([T, 5, 3])  # right padding
    attention = (torch.arange(T) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(T) >= PROMPT)
    behavior = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    return vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.tensor([1.0, 0.0, 0.5], dtype=dtype),
                             group_index=torch.tensor([0, 0, 1]), num_groups=2)


def _logp(model, rb):
    from vcpo.step import token_logp

    logits = model(input_ids=rb.input_ids, attention_mask=rb.attention_mask, use_cache=False).logits
    return token_logp(logits[:, :-1], rb.input_ids[:, 1:]) * (rb.loss_mask[:, 1:] != 0)


def check(model_type: str) -> tuple[str, str]:
    """("exact", max relative error) | ("refused", the error) | ("cannot be built", why); raises Wrong."""
    import vcpo
    import vcpo_kernels as vk
    from vcpo.grad_norms import PerSequenceGradients, UnsupportedModuleError

    try:
        model, dtype = build(model_type)
        rb = batch(dtype)
        reference = copy.deepcopy(model)
        logp = _logp(model, rb)
        if logp.dtype != dtype:  # logits cast to float32 by the model (Mamba's): float32 log-probs
            dtype = logp.dtype
            rb = batch(dtype)
    except Exception as err:  # noqa: BLE001 -- a config it rejects, a missing package, a model needing other inputs
        return "cannot be built", f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    # float64 models still compute a few parts in float32 (Gemma's norms, MoE routers' softmax): their gradients,
    # summed in a different order per sequence than in the batch, carry float32 rounding (about 1e-8 relative in
    # the updates); a wrong rule is off by percents (Gemma's scaled embedding taken as a plain one: 50%)
    tol = 1e-6 if dtype == torch.float64 else 1e-3
    params = [p for p in model.parameters() if p.requires_grad]
    per_seq = [torch.autograd.grad(logp[i].sum(), params, retain_graph=True, allow_unused=True) for i in range(B)]
    want = torch.stack([sum(g.detach().double().pow(2).sum() for g in gs if g is not None) for gs in per_seq])
    try:
        with PerSequenceGradients(model, num_seqs=B, seq_len=T) as psg:
            psg.backward(_logp(model, rb).sum())
        got = psg.sq_norms()
    except UnsupportedModuleError as err:
        return "refused", str(err).split(". Exact per-sequence")[0]
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= tol:
        raise Wrong(f"{model_type}: per-sequence norms off by {err:.2e} relative (got {got.tolist()}, "
                    f"want {want.tolist()})")

    # one vcpo.step (book-keeping) against the update assembled from the per-sequence gradients
    config = vcpo.VCPOConfig(ess_base_ratio=1.0, grad_clip=None, backend="torch")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        vcpo.step(model, opt, rb, config)
    except UnsupportedModuleError as err:
        return "refused", "in vcpo.step: " + str(err).split(". Exact per-sequence")[0]
    mask = rb.loss_mask[:, 1:] != 0
    leaf = logp.detach().requires_grad_()
    out = vk.policy_loss(leaf, rb.behavior_logp[:, 1:], mask=mask, rewards=rb.rewards, group_index=rb.group_index,
                         num_groups=rb.num_groups, grad_sq_norm=want.to(dtype), options=config, backend="torch")
    (dlogp,) = torch.autograd.grad(out.loss, leaf)
    k = (dlogp * mask).sum(1) / mask.sum(1).clamp(min=1)  # d loss / d log pi is constant per sequence here
    lr = 1e-2 * out.lr_scale.item()
    # relative to the largest update of any parameter: a few models compute parts in float32 even in a float64
    # model (Gemma's norms, MoE routers' softmax), so their own tiny updates carry float32 rounding
    diff = scale = 0.0
    trainable = [q for q in reference.parameters() if q.requires_grad]
    for p, q, *gs in zip(params, trainable, *per_seq):
        update = lr * sum((k[i] * g for i, g in enumerate(gs) if g is not None), torch.zeros_like(q))
        diff = max(diff, float((p.detach() - (q.detach() - update)).abs().max()))
        scale = max(scale, float(update.abs().max()))
    step_err = diff / scale
    if not step_err <= tol:
        raise Wrong(f"{model_type}: vcpo.step update off by {step_err:.2e} relative to the update's size")
    return "exact", f"{max(err, step_err):.0e} ({'fp64' if dtype == torch.float64 else 'fp32'})"


def all_model_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    torch.set_num_threads(1)  # tiny tensors: threads only add contention (5x slower on a busy 2-core machine)
    types = argv or all_model_types()
    print(f"transformers {transformers.__version__}, {len(types)} architectures\n")
    print("| model_type | class | result | detail |\n|---|---|---|---|")
    for t in types:
        start = time.perf_counter()
        try:
            result, detail = check(t)
        except Wrong as err:
            result, detail = "**WRONG**", str(err)[:150]
        print(f"{t}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        print(f"| {t} | {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]} | {result} | {detail.replace('|', '/')} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
