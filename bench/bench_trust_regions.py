"""Forward+backward of vcpo_kernels.policy_loss under each trust region on the CPU: the fused C++ op against the
eager float reference of the same rule, interleaved rounds, medians and their ratio in one table. The inputs of
bench_policy_loss.py (B = 512 sequences of a 2048-token row, about 0.4M counted tokens, fp32, packed), in bypass
mode (the ratio pi / mu, no IS correction of VCPO's own) and with old_logp (decoupled: truncated IS on pi_old / mu).

    python bench/bench_trust_regions.py [--rounds 7]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_policy_loss import fwd_bwd, loss_fn, make_inputs  # noqa: E402

torch.set_num_threads(2)
RULES = {  # the presets' bounds (vcpo train --loss <rule>)
    "none": {},
    "ppo": dict(clip_ratio=(0.2, 0.28)),
    "gspo": dict(trust_region="gspo", clip_ratio=(3e-4, 4e-4)),
    "gmpo": dict(trust_region="gmpo", clip_ratio=(0.4, 0.4)),
    "cispo": dict(trust_region="cispo", clip_ratio=(1.0, 0.2)),
    "dppo_tv": dict(trust_region="dppo_tv", clip_ratio=(0.15, 0.15)),
    "sapo": dict(trust_region="sapo"),
}


def median_seconds(step, rounds: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    inputs = make_inputs("packed")
    g = torch.Generator().manual_seed(1)
    old = inputs["logp"] + 0.05 * torch.randn(inputs["logp"].shape, generator=g)
    tokens = inputs["logp"].numel()
    print(f"{tokens} tokens, {len(inputs['rewards'])} sequences, torch threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds each (medians; fused and eager interleaved per rule)")
    print(f"| rule | mode | eager ms | fused ms | eager / fused |\n|---|---|---|---|---|")
    for rule, options in RULES.items():
        for mode in ("bypass", "old_logp"):
            kw = dict(inputs, **options)
            if mode == "bypass":
                kw["is_correction"] = "none"
            else:
                kw["old_logp"] = old
            eager, fused = [], []
            for _ in range(args.rounds):  # interleaved: the machine's load falls on both alike
                eager.append(median_seconds(fwd_bwd(loss_fn("torch"), kw), 1))
                fused.append(median_seconds(fwd_bwd(loss_fn("cpu"), kw), 1))
            e, f = statistics.median(eager) * 1e3, statistics.median(fused) * 1e3
            print(f"| {rule} | {mode} | {e:.1f} | {f:.1f} | {e / f:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
