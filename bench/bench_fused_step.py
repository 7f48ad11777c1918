"""vcpo.step with and without the fused LM head (VCPOConfig.fused_lm_head): time and peak memory of one update
of a small Hugging Face Llama with a large vocabulary, default VCPO options (exact per-sequence norms,
book-keeping), side by side. Each case runs in its own process (peak resident memory over what the process
held after a warm-up step); rounds are interleaved; medians.

    .venv/bin/python bench/bench_fused_step.py                     # V=32768, H=256, 2 layers, B=8, T=512
    .venv/bin/python bench/bench_fused_step.py --tied --vocab 151936
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import peak_rss_mib, rss_mib

CASES = ("unfused", "fused")


def child(case: str, args) -> None:
    import torch
    import transformers

    import vcpo

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=args.length, tie_word_embeddings=args.tied)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    b, t = args.batch, args.length
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (b, t), generator=g)
    ones = torch.ones(b, t, dtype=torch.long)
    loss_mask = (torch.arange(t) >= t // 4).long().expand(b, t)
    batch = vcpo.RolloutBatch(ids, ones, loss_mask, -3.0 + 0.1 * torch.randn(b, t, generator=g),
                              torch.rand(b, generator=g), group_index=torch.arange(b) // 4, num_groups=b // 4)
    cfg = vcpo.VCPOConfig(fused_lm_head=case == "fused")
    vcpo.step(model, opt, batch, cfg)  # warm-up
    base = rss_mib()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        metrics = vcpo.step(model, opt, batch, cfg)
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mib()
    print(json.dumps({"times": times, "peak_over_base_mib": peak - base,
                      "grad_sq_norm_mean": metrics["grad_sq_norm_mean"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return
    n = args.batch * (args.length - 1)
    print(f"vcpo.step: Llama H={args.hidden} layers={args.layers} V={args.vocab} tied={args.tied}, B={args.batch} "
          f"T={args.length}, fp32; logits would be {n * args.vocab * 4 / 2**20:.0f} MiB")
    results = {c: {"times": [], "peak": []} for c in CASES}
    flags = [a for a in sys.argv[1:] if a != "--child"]
    for r in range(args.rounds):
        for case in CASES:
            proc = subprocess.run([sys.executable, __file__, *flags, "--child", case], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{case}: failed ({proc.returncode}): {proc.stderr[-600:]}")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            results[case]["times"] += out["times"]
            results[case]["peak"].append(out["peak_over_base_mib"])
            print(f"  round {r + 1} {case:8s} {min(out['times']):7.2f} s  peak +{out['peak_over_base_mib']:.0f} MiB  "
                  f"mean G_i {out['grad_sq_norm_mean']:.6g}", flush=True)
    print(f"\n{'case':10s}{'median s':>10s}{'peak MiB':>12s}{'time / fused':>14s}{'peak / fused':>14s}")
    ours = results["fused"]
    for case in CASES:
        t, m = results[case]["times"], results[case]["peak"]
        if t and ours["times"]:
            print(f"{case:10s}{statistics.median(t):10.2f}{statistics.median(m):12.0f}"
                  f"{statistics.median(t) / statistics.median(ours['times']):14.2f}"
                  f"{statistics.median(m) / max(statistics.median(ours['peak']), 1):14.1f}")


if __name__ == "__main__":
    main()
