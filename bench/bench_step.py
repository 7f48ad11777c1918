"""VCPO update step with exact per-sequence gradient norms vs a plain GRPO step vs the brute-force loop of the
public reference code (one forward and backward per sequence for the norms, then the update).

Models (random init, fp32): `llama`, about 10M parameters (hidden 256, 6 layers, vocab 10000); `qwen3_moe`, a
mixture of experts of about 17M parameters (hidden 256, 4 layers, 16 experts of intermediate size 256, top 4,
vocab 10000, transformers' default grouped_mm experts). Batch 32 sequences x 256 tokens (32-token prompts,
responses of 64 to 224 tokens, right padding). Each case runs in its own process, so its peak resident memory is
its own.

    python bench/bench_step.py            # all cases, prints one table
    python bench/bench_step.py --rounds 5 --model qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "grpo": "plain GRPO step: one forward + backward",
    "vcpo": "VCPO, exact norms, book-keeping gradient",
    "vcpo-two-pass": "VCPO, exact norms, second backward",
    "brute-force": "per-sequence forward+backward for the norms, then the update",
}
B, T, PROMPT = 32, 256, 32


def build(name: str = "llama"):
    import torch
    import transformers

    import vcpo

    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=10000, hidden_size=256, intermediate_size=688,
                                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
                                          max_position_embeddings=T)
    else:
        config = transformers.Qwen3MoeConfig(vocab_size=10000, hidden_size=256, intermediate_size=688,
                                             moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             head_dim=64, max_position_embeddings=T)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()  # eval: no dropout
    with torch.no_grad():  # routers start at zero: random routing instead of ties
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10000, (B, T), generator=g)
    lengths = PROMPT + torch.randint(64, T - PROMPT + 1, (B,), generator=g)
    attention = (torch.arange(T) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(T) >= PROMPT)
    behavior = -torch.rand(B, T, generator=g) * 8 - 6  # log mu of random tokens under a near-uniform policy
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.randint(0, 2, (B,), generator=g).float(),
                              group_index=torch.arange(B) // 8, num_groups=B // 8)
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


def run_case(case: str, rounds: int, name: str) -> dict:
    import torch

    import vcpo

    model, batch = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    if case == "grpo":
        config = vcpo.VCPOConfig(advantage="grpo", grad_norms="uniform", lr_rule=None, is_correction="none")
    elif case == "vcpo-two-pass":
        config = vcpo.VCPOConfig(assembly="two_pass")
    else:
        config = vcpo.VCPOConfig()
    fn = (lambda: brute_force_step(model, optimizer, batch, config)) if case == "brute-force" else (
        lambda: vcpo.step(model, optimizer, batch, config))
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return dict(case=case, median_s=statistics.median(times), min_s=min(times), params=params,
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=["llama", "qwen3_moe"], default="llama")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.rounds, args.model)))
        return
    # Rounds are interleaved across cases (one process per case and round: a warm-up step, then one timed
    # step), so a slow spell of the machine hits every case alike.
    samples = {case: [] for case in CASES}
    for r in range(args.rounds):
        for case in CASES:
            print(f"round {r + 1}/{args.rounds}: {case} ({CASES[case]}) ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--case", case, "--rounds", "1", "--model", args.model],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"case {case} failed:\n{out.stderr[-3000:]}")
            samples[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
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
