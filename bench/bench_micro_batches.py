"""Peak memory and time of one `vcpo.step` against `micro_batch_size`.

Model (random init, fp32): a Llama of about 10M parameters (hidden 256, 6 layers, vocab 10000, untied head, SDPA
attention). Batch: 16 sequences x 512 tokens, 64-token prompts, responses of 96 to 448 tokens (right padding), 8
prompt groups of 2. Cases: the VCPO defaults (exact norms, book-keeping: one forward per micro-batch) at every
micro-batch size, and `opob_scope="batch"` (whose baseline needs the whole batch: a norm pass over the
micro-batches, then a second forward and backward of each). Each round of each case runs in its own process (a
warm-up step, then one timed step; SGD, so no optimizer state): its peak resident memory above what the process
held before the first step is the step's (on a GPU, `--device cuda`: the peak of allocated device memory).

    python bench/bench_micro_batches.py              # every case, 3 rounds, one table
    python bench/bench_micro_batches.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import cpu_seconds, other_cpu_seconds, peak_rss_mib, rss_mib

B, T, PROMPT, GROUP = 16, 512, 64, 2
# case -> (micro_batch_size, extra options)
CASES = {
    "whole": (None, {}),
    "m=8": (8, {}),
    "m=4": (4, {}),
    "m=2": (2, {}),
    "batch-scope whole": (None, {"opob_scope": "batch"}),
    "batch-scope m=4": (4, {"opob_scope": "batch"}),
}


def build(device: str):
    import torch
    import transformers

    import vcpo

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=10000, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=T)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(device).eval()  # eval: no dropout
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10000, (B, T), generator=g)
    lengths = PROMPT + torch.randint(96, T - PROMPT + 1, (B,), generator=g)
    attention = (torch.arange(T) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(T) >= PROMPT)
    behavior = -torch.rand(B, T, generator=g) * 8 - 6  # log mu of random tokens under a near-uniform policy
    batch = vcpo.RolloutBatch(*(x.to(device) for x in (ids, attention, loss_mask, behavior,
                                                       torch.randint(0, 2, (B,), generator=g).float(),
                                                       torch.arange(B) // GROUP)), num_groups=B // GROUP)
    return model, batch


def run_case(case: str, device: str) -> dict:
    import torch

    import vcpo

    model, batch = build(device)
    micro, options = CASES[case]
    config = vcpo.VCPOConfig(micro_batch_size=micro, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    before = rss_mib()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    vcpo.step(model, optimizer, batch, config)  # warm-up
    start = time.perf_counter()
    metrics = vcpo.step(model, optimizer, batch, config)  # reads the metrics: the step has finished
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()
    return dict(case=case, seconds=seconds, peak_mib=peak - before, ess_ratio=metrics["ess_ratio"],
                grad_norm=metrics["grad_norm"], params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.device)))
        return
    # Rounds are interleaved across cases, so a slow spell of the machine hits every case alike.
    samples = {case: [] for case in CASES}
    start, wall = cpu_seconds(), time.perf_counter()
    for r in range(args.rounds):
        for case in CASES:
            print(f"round {r + 1}/{args.rounds}: {case} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--case", case, "--device", args.device],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"case {case} failed:\n{out.stderr[-3000:]}")
            samples[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    foreign, wall = other_cpu_seconds(start, cpu_seconds()), time.perf_counter() - wall
    table = {case: dict(s=statistics.median(x["seconds"] for x in runs),
                        peak=statistics.median(x["peak_mib"] for x in runs),
                        grad_norm=runs[0]["grad_norm"]) for case, runs in samples.items()}
    params = samples["whole"][0]["params"]
    what = "peak allocated CUDA memory" if args.device == "cuda" else "peak RSS above the process before the step"
    print(f"\nvcpo.step against micro_batch_size: Llama {params / 1e6:.1f}M params, B={B} x T={T}, groups of "
          f"{GROUP}, fp32, {args.device}, {args.rounds} rounds, medians; peak = {what}")
    print(f"  other processes used {foreign:.0f} CPU-s during the {wall:.0f} s run "
          f"({foreign / (wall * os.cpu_count()):.0%} of the machine): times are only as good as that")
    print(f"  {'case':<19} {'step s':>7} {'x whole':>8} {'peak MiB':>9} {'x whole':>8} {'grad norm':>10}")
    for case, r in table.items():
        base = table["batch-scope whole" if case.startswith("batch-scope") else "whole"]
        print(f"  {case:<19} {r['s']:7.2f} {r['s'] / base['s']:8.2f} {r['peak']:9.0f} {r['peak'] / base['peak']:8.2f} "
              f"{r['grad_norm']:10.6f}")


if __name__ == "__main__":
    main()
