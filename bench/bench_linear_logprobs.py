"""Log-probs from hidden states, forward + backward: time and peak memory of eager PyTorch (logits ->
log_softmax -> gather), torch.compile of it, and vcpo_kernels.linear_logprobs with its C++ passes over each
chunk of logits ("vcpo cpu", what backend="auto" picks) and with the torch reference passes ("vcpo torch").

Each case runs in its own process, so that its peak resident memory is its own: the table gives the peak
over the inputs (hidden, weight, targets and their gradients' buffers are allocated before the baseline is
read). Rounds of the cases are interleaved; medians and minimums of the per-round times.

    .venv/bin/python bench/bench_linear_logprobs.py                       # N=8192, H=1024, V=32768
    .venv/bin/python bench/bench_linear_logprobs.py --vocab 151936 --rounds 1
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from memory import peak_rss_mib, rss_mib

CASES = ("eager", "compile", "vcpo torch", "vcpo cpu")


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

    fn = {"eager": eager, "compile": torch.compile(eager),
          "vcpo torch": lambda hs, w: vk.linear_logprobs(hs, w, targets, validate=False, backend="torch").logp,
          "vcpo cpu": lambda hs, w: vk.linear_logprobs(hs, w, targets, validate=False, backend="cpu").logp}[case]

    def run():
        lp = fn(hidden, weight)
        (lp * upstream).sum().backward()

    run()  # warm-up (and compilation)
    base = rss_mib()  # inputs, their gradient buffers and whatever the warm-up left resident
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mib()
    print(json.dumps({"times": times, "peak_over_inputs_mib": peak - base}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=1, help="timed fwd+bwd calls per process")
    p.add_argument("--child", help=argparse.SUPPRESS)
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
            if proc.returncode != 0:
                print(f"{case}: failed ({proc.returncode}): {proc.stderr[-400:]}")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            results[case]["times"] += out["times"]
            results[case]["peak"].append(out["peak_over_inputs_mib"])
            print(f"  round {r + 1} {case:10s} {min(out['times']):8.2f} s  peak +{out['peak_over_inputs_mib']:.0f} MiB",
                  flush=True)
    print(f"\n{'case':12s}{'median s':>10s}{'min s':>10s}{'peak MiB':>12s}{'time / ours':>13s}{'peak / ours':>13s}"
          "   (ours: vcpo cpu)")
    ours = results["vcpo cpu"]
    for case in CASES:
        t, m = results[case]["times"], results[case]["peak"]
        if not t:
            continue
        print(f"{case:12s}{statistics.median(t):10.2f}{min(t):10.2f}{statistics.median(m):12.0f}"
              f"{statistics.median(t) / statistics.median(ours['times']):13.2f}"
              f"{statistics.median(m) / max(statistics.median(ours['peak']), 1):13.1f}")


if __name__ == "__main__":
    main()
