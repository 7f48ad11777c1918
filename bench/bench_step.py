"""VCPO update step with exact per-sequence gradient norms vs a plain GRPO step vs the brute-force loop of the
public reference code (one forward and backward per sequence for the norms, then the update).

Models (random init, fp32): `llama`, about 10M parameters (hidden 256, 6 layers, vocab 10000); `qwen3_moe`, a
mixture of experts of about 17M parameters (hidden 256, 4 layers, 16 experts of intermediate size 256, top 4,
vocab 10000, transformers' default grouped_mm experts). Batch 32 sequences x 256 tokens (32-token prompts,
responses of 64 to 224 tokens, right padding). Each case runs in its own process, so its peak resident memory is
its own.

    python bench/bench_step.py            # all cases, prints one table
    python bench/bench_step.py --rounds 5 --model qwen3_moe
    python bench/bench_step.py --sweep    # VCPO over GRPO as T and the width grow (2-layer Llamas)
    python bench/bench_step.py --profile --model qwen3_moe    # where the step's time goes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Optional

from common import GRPO, form_counts, norm_forms, peak_rss_mib

CASES = {
    "grpo": "plain GRPO step: one forward + backward",
    "vcpo": "VCPO, exact norms, book-keeping gradient",
    "vcpo-two-pass": "VCPO, exact norms, second backward",
    "brute-force": "per-sequence forward+backward for the norms, then the update",
}
B, T, PROMPT = 32, 256, 32
# The sweep (--sweep): B = SWEEP_TOKENS / T sequences, so each case holds the same number of tokens.
SWEEP_T, SWEEP_WIDTH, SWEEP_TOKENS, SWEEP_LAYERS = (256, 1024, 4096), (256, 1024, 2048), 4096, 2


def build(name: str = "llama", b: int = B, t: int = T, width: int = 256, layers: int = 6):
    """The model and a batch of b sequences x t tokens; width and layers size the Llama (the MoE is fixed)."""
    import torch
    import transformers

    import vcpo

    torch.manual_seed(0)
    if name == "llama":  # the MLP at 688/256 of the width, 64-dimensional heads
        config = transformers.LlamaConfig(vocab_size=10000, hidden_size=width, intermediate_size=688 * width // 256,
                                          num_hidden_layers=layers, num_attention_heads=width // 64,
                                          num_key_value_heads=width // 64, max_position_embeddings=t)
    else:
        config = transformers.Qwen3MoeConfig(vocab_size=10000, hidden_size=256, intermediate_size=688,
                                             moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             head_dim=64, max_position_embeddings=t)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()  # eval: no dropout
    with torch.no_grad():  # routers start at zero: random routing instead of ties
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10000, (b, t), generator=g)
    lengths = PROMPT + torch.randint(t // 4, t - PROMPT + 1, (b,), generator=g)  # responses of t/4 to t - 32
    attention = (torch.arange(t) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(t) >= PROMPT)
    behavior = -torch.rand(b, t, generator=g) * 8 - 6  # log mu of random tokens under a near-uniform policy
    group = min(b, 8)
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.randint(0, 2, (b,), generator=g).float(),
                              group_index=torch.arange(b) // group, num_groups=b // group)
    return model, batch


def brute_force_step(model, optimizer, batch, config):
    """What the reference implementation does: micro-batch 1, a forward and backward per sequence and the
    full-model gradient norm after each, then a normal forward+backward of the loss for the update."""
    import torch

    import vcpo
    import vcpo_kernels
    from vcpo.step import token_logp

    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.loss_mask[:, 1:] != 0
    g_sq = []
    for i in range(batch.input_ids.shape[0]):
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids[i:i + 1], attention_mask=batch.attention_mask[i:i + 1]).logits
        (token_logp(logits[:, :-1], batch.input_ids[i:i + 1, 1:]) * mask[i:i + 1]).sum().backward()
        g_sq.append(torch.stack([p.grad.pow(2).sum() for p in params]).sum())
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logp(logits[:, :-1], batch.input_ids[:, 1:])
    out = vcpo_kernels.policy_loss(logp, batch.behavior_logp[:, 1:], mask=mask, rewards=batch.rewards,
                                   group_index=batch.group_index, num_groups=batch.num_groups,
                                   grad_sq_norm=torch.stack(g_sq), options=config)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    with vcpo.scale_lr(optimizer, float(out.lr_scale)):
        optimizer.step()


def run_case(case: str, rounds: int, name: str, shape: Optional[tuple] = None) -> dict:
    """shape: (b, t, width, layers) of a sweep case, else the default model and batch."""
    import torch

    import vcpo

    model, batch = build(name, *shape) if shape else build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    if case == "grpo":
        config = vcpo.VCPOConfig(**GRPO)
    elif case == "vcpo-two-pass":
        config = vcpo.VCPOConfig(assembly="two_pass")
    else:
        config = vcpo.VCPOConfig()
    fn = (lambda: brute_force_step(model, optimizer, batch, config)) if case == "brute-force" else (
        lambda: vcpo.step(model, optimizer, batch, config))
    with norm_forms() as forms:  # the warm-up step's norm forms
        fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return dict(case=case, median_s=statistics.median(times), min_s=min(times), params=params,
                peak_rss_mib=peak_rss_mib(), forms=forms)


def child(args: list) -> dict:
    """One case in a process of its own: its peak resident memory is its own."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(rounds: int) -> None:
    """The VCPO step over a plain GRPO step as the sequence length and the width grow. Each case's row is
    printed once its rounds are done (rounds interleave the two steps of a case), the narrowest cases first."""
    print(f"VCPO step / plain GRPO step, Llama {SWEEP_LAYERS} layers, vocab 10000, B x T = {SWEEP_TOKENS} tokens, "
          f"fp32, {rounds} rounds, median; forms: recorded calls per layer kind, g ghost, m materialised")
    print(f"  {'T':>5} {'B':>3} {'width':>5} {'params':>7} {'grpo s':>7} {'vcpo s':>7} {'x grpo':>6} {'<=1.3':>5} "
          f"{'grpo MiB':>8} {'vcpo MiB':>8}  forms", flush=True)
    for shape in [(SWEEP_TOKENS // t, t, w, SWEEP_LAYERS) for w in SWEEP_WIDTH for t in SWEEP_T]:
        samples = {"grpo": [], "vcpo": []}
        for r in range(rounds):
            for case in samples:
                print(f"round {r + 1}/{rounds}: B={shape[0]} T={shape[1]} width {shape[2]}: {case} ...",
                      file=sys.stderr, flush=True)
                samples[case].append(child(["--case", case, "--rounds", "1", "--shape", ",".join(map(str, shape))]))
        g, v = samples["grpo"], samples["vcpo"]
        tg, tv = statistics.median(x["median_s"] for x in g), statistics.median(x["median_s"] for x in v)
        print(f"  {shape[1]:5d} {shape[0]:3d} {shape[2]:5d} {g[0]['params'] / 1e6:6.1f}M {tg:7.2f} {tv:7.2f} "
              f"{tv / tg:6.2f} {'yes' if tv / tg <= 1.3 else 'no':>5} {max(x['peak_rss_mib'] for x in g):8.0f} "
              f"{max(x['peak_rss_mib'] for x in v):8.0f}  {form_counts(v[0]['forms'])}", flush=True)


PHASES = ("forward", "PerSequenceGradients.backward", "PerSequenceGradients.sq_norms", "experts.sq_norms",
          "experts._terms", "replay.per_seq", "PerSequenceGradients.assemble", "experts.assemble", "replay.weighted",
          "optimizer.step")  # owner.attribute: a method of PerSequenceGradients or a function of vcpo.grad_norms

TOP_PHASES = ("forward", "PerSequenceGradients.backward", "PerSequenceGradients.sq_norms",
              "PerSequenceGradients.assemble", "optimizer.step")  # not nested in one another


def profile(name: str) -> None:
    """Where the VCPO step's time goes: each phase's wall time (inclusive: a nested phase is also in its
    caller's) in one step after a warm-up, and a plain GRPO step of the same model and batch."""
    import torch

    import vcpo
    from vcpo.grad_norms import experts, replay

    model, batch = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start
        return wrapper

    for phase in PHASES:
        owner, _, attr = phase.partition(".")
        target = {"PerSequenceGradients": vcpo.PerSequenceGradients, "experts": experts, "replay": replay}.get(owner)
        if target is not None:
            setattr(target, attr, timed(phase, getattr(target, attr)))
    model.forward = timed("forward", model.forward)
    optimizer.step = timed("optimizer.step", optimizer.step)
    configs = {"vcpo": vcpo.VCPOConfig(),
               "grpo": vcpo.VCPOConfig(advantage="grpo", grad_norms="uniform", lr_rule=None, is_correction="none")}
    for case, config in configs.items():
        vcpo.step(model, optimizer, batch, config)  # warm-up
        spent.update(dict.fromkeys(PHASES, 0.0))
        start = time.perf_counter()
        vcpo.step(model, optimizer, batch, config)
        total = time.perf_counter() - start
        print(f"\n{case} step, {name}, B={B} x T={T}: {total:.2f} s")
        for phase in PHASES:
            if spent[phase]:
                print(f"  {phase:<42} {spent[phase]:7.2f} s {spent[phase] / total:6.1%}")
        rest = total - sum(spent[p] for p in TOP_PHASES)
        print(f"  {'the rest (loss, a plain backward, clipping)':<42} {rest:7.2f} s {rest / total:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=["llama", "qwen3_moe"], default="llama")
    parser.add_argument("--sweep", action="store_true", help="VCPO over GRPO across sequence lengths and widths")
    parser.add_argument("--profile", action="store_true", help="the time of each phase of one step (--model)")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in a child process
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # a sweep case's B,T,width,layers
    args = parser.parse_args()
    if args.case:
        shape = tuple(map(int, args.shape.split(","))) if args.shape else None
        print(json.dumps(run_case(args.case, args.rounds, args.model, shape)))
        return
    if args.sweep:
        sweep(args.rounds)
        return
    if args.profile:
        profile(args.model)
        return
    # Rounds are interleaved across cases (one process per case and round: a warm-up step, then one timed
    # step), so a slow spell of the machine hits every case alike.
    samples = {case: [] for case in CASES}
    for r in range(args.rounds):
        for case in CASES:
            print(f"round {r + 1}/{args.rounds}: {case} ({CASES[case]}) ...", file=sys.stderr, flush=True)
            samples[case].append(child(["--case", case, "--rounds", "1", "--model", args.model]))
    results = {case: dict(median_s=statistics.median(x["median_s"] for x in runs),
                          min_s=min(x["min_s"] for x in runs), params=runs[0]["params"],
                          peak_rss_mib=max(x["peak_rss_mib"] for x in runs))
               for case, runs in samples.items()}
    base = results["grpo"]["median_s"]
    print(f"\nVCPO step, {args.model} {results['grpo']['params'] / 1e6:.1f}M params, B={B} x T={T}, fp32, "
          f"{args.rounds} rounds, median")
    print(f"  {'case':<15} {'median s':>9} {'min s':>7} {'x grpo':>7} {'peak RSS MiB':>13}")
    for case, r in results.items():
        print(f"  {case:<15} {r['median_s']:9.2f} {r['min_s']:7.2f} {r['median_s'] / base:7.2f} "
              f"{r['peak_rss_mib']:13.0f}")
    vcpo_t, brute_t = results["vcpo"]["median_s"], results["brute-force"]["median_s"]
    print(f"  vcpo / grpo        {vcpo_t / base:5.2f}x   target <= 1.3x  {'MET' if vcpo_t / base <= 1.3 else 'MISSED'}")
    print(f"  brute-force / vcpo {brute_t / vcpo_t:5.2f}x   target >= 5x    {'MET' if brute_t / vcpo_t >= 5 else 'MISSED'}")


if __name__ == "__main__":
    main()
