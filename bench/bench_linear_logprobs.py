"""Log-probs from hidden states, forward + backward: time and peak memory of eager PyTorch (logits ->
log_softmax -> gather), torch.compile of it, and vcpo_kernels.linear_logprobs with its C++ passes over each
chunk of logits ("vcpo cpu", what backend="auto" picks) and with the torch reference passes ("vcpo torch"), and
a peer: Liger-Kernel's chunked fused-linear GRPO loss ("liger grpo", `liger_kernel.chunked_loss`, plain PyTorch
under torch.compile, its defaults but no reference model; `pip install liger-kernel==0.8.5`; skipped when absent).

Not the same computation: Liger's loss takes the whole GRPO loss into its chunks (ratios, clipping, the mean over
tokens) and gives the gradients of that scalar alone; ours gives the log-prob of every token (and on request the
entropy, sum p^2, per-sequence norms of the head's gradient) with autograd from any upstream gradient. The
first call of each case (torch.compile's compilation for "compile" and "liger grpo") is left out of the times
and reported on its own.

Each case runs in its own process, so that its peak resident memory is its own: the table gives the peak
over the inputs (hidden, weight, targets and their gradients' buffers are allocated before the baseline is
read). Rounds of the cases are interleaved; medians and minimums of the per-round times.

    .venv/bin/python bench/bench_linear_logprobs.py                       # N=8192, H=1024, V=32768
    .venv/bin/python bench/bench_linear_logprobs.py --vocab 151936 --rounds 1
    .venv/bin/python bench/bench_linear_logprobs.py --json table.json    # the table as JSON too
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import peak_rss_mib, rss_mib

CASES = ("eager", "compile", "liger grpo", "vcpo torch", "vcpo cpu")
LIGER_SEQUENCES = 8  # Liger takes [B, T, H]: the N tokens as 8 sequences


def child(case: str, n: int, h: int, v: int, reps: int) -> None:
    import torch

    import vcpo_kernels as vk

    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) / h ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,))
    upstream = torch.randn(n)
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)

    def eager(hs, w):
        return torch.log_softmax((hs @ w.T).float(), -1).gather(-1, targets[:, None])[:, 0]

    if case == "liger grpo":
        run = liger_grpo_step(hidden, weight, targets)
    else:
        fn = {"eager": eager, "compile": torch.compile(eager),
              "vcpo torch": lambda hs, w: vk.linear_logprobs(hs, w, targets, validate=False, backend="torch").logp,
              "vcpo cpu": lambda hs, w: vk.linear_logprobs(hs, w, targets, validate=False, backend="cpu").logp}[case]

        def run():
            lp = fn(hidden, weight)
            (lp * upstream).sum().backward()

    t0 = time.perf_counter()
    run()  # warm-up (and compilation)
    first = time.perf_counter() - t0
    base = rss_mib()  # inputs, their gradient buffers and whatever the warm-up left resident
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mib()
    print(json.dumps({"times": times, "first_call": first, "peak_over_inputs_mib": peak - base}))


def liger_grpo_step(hidden, weight, targets):
    """fwd+bwd of Liger's fused-linear GRPO loss on the same tokens as B sequences (advantages at random)."""
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(use_ref_model=False, beta=0.0)
    b = LIGER_SEQUENCES
    ids, mask, advantages = targets.view(b, -1), torch.ones(b, targets.numel() // b), torch.randn(b)

    def run():
        loss, _ = loss_fn(hidden.view(b, -1, hidden.shape[1]), weight, ids, mask, advantages)
        loss.backward()

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=1, help="timed fwd+bwd calls per process")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    args = p.parse_args()
    if args.child:
        child(args.child, args.tokens, args.hidden, args.vocab, args.reps)
        return
    import torch

    print(f"N={args.tokens} H={args.hidden} V={args.vocab}, fp32, forward+backward, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; logits would be {args.tokens * args.vocab * 4 / 2**20:.0f} MiB")
    results = {c: {"times": [], "peak": []} for c in CASES}
    for r in range(args.rounds):
        for case in CASES:
            cmd = [sys.executable, __file__, "--child", case, "--tokens", str(args.tokens), "--hidden",
                   str(args.hidden), "--vocab", str(args.vocab), "--reps", str(args.reps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
            if proc.returncode != 0 and "No module named 'liger_kernel'" in proc.stderr:
                print(f"{case}: skipped, liger-kernel is not installed (pip install liger-kernel==0.8.5)")
                continue
            if proc.returncode != 0:
                print(f"{case}: failed ({proc.returncode}): {proc.stderr[-400:]}")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            results[case]["times"] += out["times"]
            results[case]["peak"].append(out["peak_over_inputs_mib"])
            results[case].setdefault("first", []).append(out["first_call"])
            print(f"  round {r + 1} {case:10s} {min(out['times']):8.2f} s  peak +{out['peak_over_inputs_mib']:.0f} MiB",
                  flush=True)
    print(f"\n{'case':12s}{'median s':>10s}{'min s':>10s}{'first s':>10s}{'peak MiB':>12s}{'time / ours':>13s}"
          f"{'peak / ours':>13s}   (ours: vcpo cpu; first: the warm-up call, not in the times)")
    ours = results["vcpo cpu"]
    table = {}
    for case in CASES:
        t, m = results[case]["times"], results[case]["peak"]
        if not t:
            continue
        table[case] = {"median_s": statistics.median(t), "min_s": min(t), "first_call_s": statistics.median(
            results[case]["first"]), "peak_mib": statistics.median(m),
            "time_over_ours": statistics.median(t) / statistics.median(ours["times"]),
            "peak_over_ours": statistics.median(m) / max(statistics.median(ours["peak"]), 1)}
        row = table[case]
        print(f"{case:12s}{row['median_s']:10.2f}{row['min_s']:10.2f}{row['first_call_s']:10.2f}{row['peak_mib']:12.0f}"
              f"{row['time_over_ours']:13.2f}{row['peak_over_ours']:13.1f}")
    targets = [("peak memory >= 8x below eager", "eager", "peak_over_ours", lambda r: r >= 8),
               ("time <= Liger's chunked loss", "liger grpo", "time_over_ours", lambda r: r >= 1)]
    for label, case, key, met in targets:  # the design's targets, reported, never asserted
        if case in table:
            print(f"target {label}: {'met' if met(table[case][key]) else 'missed'} ({case} / ours = "
                  f"{table[case][key]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "cases": table}, f, indent=1)

if __name__ == "__main__":
    main()
