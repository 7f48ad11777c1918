"""One `vcpo.step` in 1 process (the unsharded model, the whole batch) against 2 FSDP2 gloo ranks (the model
sharded by torch.distributed.fsdp.fully_shard, half of the batch each, one core each): step time, the largest
parameter difference after one step from the same weights, and the peak resident memory of each process
during the first step (the peak is reset after the model is built and sharded).

Models (random Llama, fp32): "tiny" (hidden 256, 4 layers, vocab 10000: 6M parameters) and "100m" (hidden 768,
12 layers, vocab 16000: 110M parameters). Batch: 16 x 256 tokens (tiny) or 8 x 128 (100m) of unequal lengths in
prompt groups of 4; each rank gets whole groups. Each case runs in processes of its own.

    python bench/bench_fsdp.py --model tiny --rounds 3
    python bench/bench_fsdp.py --model 100m --rounds 2
    python bench/bench_fsdp.py --model tiny --rounds 1 --bf16   # the ranks with bf16 mixed precision

`--bf16`: the ranks shard with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (fp32 shards and
optimizer), against the fp32 process: the parameter difference is then that of mixed precision.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_ranks import build as build_llama
from common import share, status_mib

MODELS = {  # hidden, intermediate, layers, heads, vocab, B, T
    "tiny": (256, 688, 4, 4, 10000, 16, 256),
    "100m": (768, 2048, 12, 12, 16000, 8, 128),
}
PROMPT = 16  # prompt groups of bench_ranks.GROUP = 4
CONFIGS = {"book-keeping": {"assembly": "bookkeeping"}, "two-pass": {"assembly": "two_pass"}}


def build(name: str):
    import transformers

    hidden, inter, layers, heads, vocab, b, t = MODELS[name]
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=t, tie_word_embeddings=False)
    return build_llama(config, b, t, PROMPT)


def run(rank: int, world: int, init: str, name: str, options: dict, rounds: int, out: str, bf16: bool) -> None:
    """One process: (1 process) the whole batch, or (a rank of `world`) its share on the sharded model."""
    import gc

    import torch
    import torch.distributed as dist

    import vcpo

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    model, batch = build(name)
    group = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        batch, group = share(batch, rank, world), dist.group.WORLD
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    config = vcpo.VCPOConfig(**options)
    gc.collect()
    resident = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    vcpo.step(model, optimizer, batch, config, process_group=group)
    peak = status_mib("VmHWM")  # of the first step (it also allocates AdamW's state)
    first = {k: (v.full_tensor() if world > 1 else v).detach().clone() for k, v in model.state_dict().items()}
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        vcpo.step(model, optimizer, batch, config, process_group=group)
        times.append(time.perf_counter() - start)
    if rank == 0:
        torch.save({"first": first, "median": statistics.median(times), "peak": peak, "before": resident}, out)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="the FSDP2 ranks with bf16 mixed precision")
    args = parser.parse_args()
    hidden, inter, layers, heads, vocab, b, t = MODELS[args.model]
    rows = []
    for config, options in CONFIGS.items():
        results = []
        for world in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rank0.pt")
                mp.spawn(run, args=(world, f"file://{tmp}/init", args.model, options, args.rounds, out, args.bf16),
                         nprocs=world)
                results.append(torch.load(out))
        one, two = results
        diff = max((two["first"][k] - v).abs().max().item() for k, v in one["first"].items())
        rows.append((config, one, two, diff))
    kind = f"{args.model} Llama" + (", ranks in bf16 mixed precision" if args.bf16 else "")
    print(f"| {kind}, step (B={b} x T={t}, {args.rounds} rounds, medians) | 1 process, 1 core | "
          "2 FSDP2 ranks, 1 core each | speed-up | max abs param difference after one step | peak RSS in the first "
          "step: 1 process / FSDP2 rank 0 (resident before it) |")
    print("|---|---|---|---|---|---|")
    for config, one, two, diff in rows:
        print(f"| {config} | {one['median']:.3f} s | {two['median']:.3f} s | {one['median'] / two['median']:.2f}x | "
              f"{diff:.1e} | {one['peak']:.0f} MiB ({one['before']:.0f}) / {two['peak']:.0f} MiB "
              f"({two['before']:.0f}) |")


if __name__ == "__main__":
    main()
